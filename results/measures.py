"""The code each step of results/reproduce.sh measures: the paths (files or folders, from the
repository's root) whose changes can change the step's stored outputs.

results/render.py counts, for every step a page reads, the commits since the step's stamp
that change these paths (``git log STAMP..HEAD -- PATHS``, merges left out) and says so in
the block's footer: "N later commits change the code it measures". A step whose stamp
commit is not in the history (a shallow clone) says that it cannot tell.
``python results/render.py --stale`` lists the steps with such commits and fails.
"""

# the library every run goes through: the core, the methods, their configs
LIBRARY = ("grace/", "compressors/", "memories/", "communicators/", "configs/")
# gracecomm-train and its sweeps' reports
TRAIN = (*LIBRARY, "experiments/training/", "experiments/workloads/", "experiments/reports/",
         "experiments/presets.py", "experiments/method_defaults.py")
RUNS = (*TRAIN, "results/runs.py")  # training runs stored as records
BENCH = (*LIBRARY, "experiments/bench/", "experiments/workloads/")  # gracecomm-bench
NETBENCH = (*TRAIN, "experiments/cluster/")  # gracecomm-netbench, loopback or cluster

MEASURES: dict[str, tuple[str, ...]] = {
    "grace_benchmark": TRAIN, "sidco": TRAIN, "natural": TRAIN, "deepreduce": TRAIN,
    "deepreduce_fpr": TRAIN, "sparse_model": TRAIN, "every_method": TRAIN,
    "first_run": TRAIN, "lgc_phase3": TRAIN,
    "lgc": (*TRAIN, "results/lgc_bound.py"),
    "lgc_bound_resnet20": (*TRAIN, "results/lgc_bound.py"),
    "long_run": (*TRAIN, "results/long_run.py"),
    "lgc_default": RUNS, "training_defaults": RUNS, "sidco_escape": RUNS,
    "bench_quality_residual": BENCH, "bench_sidco": BENCH, "bench_sidco_resnet20": BENCH,
    "bench_receive": BENCH, "bench_quantizers": BENCH, "bench_deepreduce": BENCH,
    "bench_fig10": BENCH, "variance": BENCH, "grace_reference": BENCH, "hook": BENCH,
    "bench_lgc": BENCH, "bench_quality": BENCH, "bench_step": BENCH,
    "bench_buffers": (*BENCH, "results/fresh_buffers.py"),
    "sidco_bound": ("results/sidco_bound.py", "compressors/shared/", "compressors/sidco.py"),
    "natural_table1": (*LIBRARY, "experiments/checks/natural_table1.py"),
    "powersgd_vs_torch": (*LIBRARY, "experiments/checks/powersgd_vs_torch.py"),
    "netbench": NETBENCH, "netbench_lgc": NETBENCH,
    "cluster_step": NETBENCH, "cluster_pinning": NETBENCH, "cluster_model": NETBENCH,
    "cluster_tta": NETBENCH, "cluster_tta8": NETBENCH, "cluster_hierarchy": NETBENCH,
    "cluster_hierarchy_1000mbit": NETBENCH, "cluster_hierarchy_2n": NETBENCH,
    "cluster_hierarchy_tta": NETBENCH,
    "cluster_strategy": NETBENCH, "cluster_strategy_tta": NETBENCH,
    "advise_check": NETBENCH,
    "cluster_collectives": ("grace/network.py", "experiments/cluster/"),
    "cluster_projection": ("grace/network.py", "experiments/cluster/"),
}
