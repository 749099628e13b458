#!/usr/bin/env bash
# Re-runs every experiment of results/README.md, one at a time (each uses 2 Gloo ranks), and
# copies the reports here. Run from the repository root, with the project installed:
#   bash results/reproduce.sh            # 2-core CPU: about an hour
#   bash results/reproduce.sh sidco lgc  # only these steps
set -euo pipefail
OUT=multirun/results
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(grace_benchmark sidco natural deepreduce lgc sparse_model \
  every_method bench_sidco bench_fig10 natural_table1 powersgd_vs_torch long_run)

train_into() {  # train_into DIR [overrides...]: a multirun into an emptied $OUT/DIR
  local dir=$1; shift
  rm -rf "${OUT:?}/$dir"  # no stale runs from an earlier sweep in the report
  gracecomm-train -m trainer.progress=false "$@" "hydra.sweep.dir=$OUT/$dir"
}

sweep() {  # sweep NAME [overrides...]: one experiment sweep into $OUT/NAME, report copied
  local name=$1; shift
  train_into "$name" "+experiment=$name" "$@"
  mkdir -p "results/$name"
  cp "$OUT/$name"/report.{md,csv} "$OUT/$name"/*.png "results/$name/"
}

for step in "${steps[@]}"; do
  echo "=== $step"
  case $step in
    grace_benchmark) sweep grace_benchmark experiment.small.epochs=10 ;;
    sidco) sweep sidco ;;
    natural) sweep natural seed=0,1,2 ;;
    deepreduce) sweep deepreduce ;;
    lgc) sweep lgc
         python -m gracecomm.experiments.lgc_report "$OUT/lgc" --plot results/lgc/recon.png > results/lgc/phases.md
         python results/lgc_bound.py | tee results/lgc/bound.md ;;
    sparse_model) sweep sparse_model ;;
    every_method) sweep every_method ;;  # 75 runs: every compressor by name, seeds 0-2
    bench_sidco)
      gracecomm-bench sizes=[26214400] ratios=[0.01,0.001] \
        distributions=[laplace,student_t] gradients=[] steps=20 repeats=3 \
        hydra.run.dir=outputs/results/bench_sidco | tee results/bench_sidco.txt ;;
    bench_fig10)
      gracecomm-bench suite=deepreduce_fig10 hydra.run.dir=outputs/results/bench_fig10 \
        | tee results/bench_fig10.txt ;;
    natural_table1) python -m gracecomm.experiments.natural_table1 | tee results/natural_table1.txt ;;
    powersgd_vs_torch) python -m gracecomm.experiments.powersgd_vs_torch | tee results/powersgd_vs_torch.txt ;;
    long_run)  # ~2,900 steps of the default experiment: state size and peak RSS over time
      train_into long_run compressor=none,topk,dgc,sidco,powersgd,deepreduce trainer.epochs=130
      mkdir -p results/long_run && cp "$OUT/long_run"/report.{md,csv} results/long_run/
      python results/long_run.py "$OUT/long_run" | tee results/long_run/memory.md ;;
    *) echo "unknown step '$step'" >&2; exit 2 ;;
  esac
done
