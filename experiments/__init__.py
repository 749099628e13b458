"""Experiments built on the library, one package each: `training` (the ``gracecomm-train``
entry point), `workloads` (models, data sets and tasks), `reports` (sweep reports), `bench`
(micro-benchmarks), `cluster` (the emulated cluster and ``gracecomm-netbench``) and `checks`
(the GPU readiness check and reproductions of published results); `presets` and
`method_defaults` name and complete the methods they all train."""
