"""LGC: learned gradient compression (Abrahamyan, Chen, Bekoulis, Deligiannis, *Learned
Gradient Compression for Distributed Deep Learning*, IEEE TNNLS), in its parameter-server
(`lgc_ps`) and ring-allreduce (`lgc_rar`) forms. See docs/lgc.md."""
