"""Checks against a device and against published results: ``gracecomm-gpucheck``
(`gpucheck`, with the host-synchronisation counter `hostwatch`), Natural compression's
Table 1 (`natural_table1`) and PowerSGD against PyTorch's own hook (`powersgd_vs_torch`)."""
