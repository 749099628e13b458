"""`gracecomm-bench` with the recycling of output buffers off (`gracecomm.buffers.RECYCLED_KEPT
= 0`): every decompressed output is written to fresh pages, which the kernel clears first, as
before the library kept dropped buffers. The step `bench_buffers` of results/reproduce.sh runs
it in turn with the plain bench, same arguments.

    python results/fresh_buffers.py 'methods=[topk,natural,signsgd]' sizes=[26214400] \\
        ratios=[0.01] gradients=[] distributions=[laplace] peak_memory=false repeats=7
"""

import sys

from gracecomm import buffers
from gracecomm.experiments.bench.__main__ import main

if __name__ == "__main__":
    buffers.RECYCLED_KEPT = 0
    sys.argv[0] = "gracecomm-bench"
    main()
