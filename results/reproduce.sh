#!/usr/bin/env bash
# Re-runs every experiment of results/README.md, one at a time (each uses 2 Gloo ranks), and
# copies the reports here. Run from the repository root, with the project installed:
#   bash results/reproduce.sh            # 2-core CPU: about two hours
#   bash results/reproduce.sh sidco lgc  # only these steps
# Each step stamps the results page (the line `<!-- stamp:STEP -->...`) with the commit and
# date its numbers come from, and says when the working tree had uncommitted changes.
# grace_reference needs a checkout of https://github.com/sands-lab/grace in $GRACE_PATH and
# is skipped, leaving its table and stamp as they were, without one.
set -euo pipefail
OUT=multirun/results
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(grace_benchmark sidco natural deepreduce deepreduce_fpr lgc \
  sparse_model every_method bench_sidco sidco_bound bench_receive bench_fig10 natural_table1 variance grace_reference \
  powersgd_vs_torch hook long_run netbench cluster_step cluster_pinning cluster_model cluster_tta \
  cluster_tta8 cluster_collectives cluster_projection cluster_report)

train_into() {  # train_into DIR [overrides...]: a multirun into an emptied $OUT/DIR
  local dir=$1; shift
  rm -rf "${OUT:?}/$dir"  # no stale runs from an earlier sweep in the report
  gracecomm-train -m trainer.progress=false "$@" "hydra.sweep.dir=$OUT/$dir"
  local run missing=()
  for run in "$OUT/$dir"/*/; do [ -f "$run/summary.json" ] || missing+=("$run"); done
  if [ ${#missing[@]} -gt 0 ]; then  # a run that failed or hit trainer.timeout_s
    echo "runs without a summary: ${missing[*]}" >&2; exit 1
  fi
}

sweep() {  # sweep NAME [overrides...]: one experiment sweep into $OUT/NAME, report copied
  local name=$1; shift
  train_into "$name" "+experiment=$name" "$@"
  mkdir -p "results/$name"
  cp "$OUT/$name"/report.{md,csv} "$OUT/$name"/*.png "results/$name/"
}

# the methods of the time-to-accuracy runs (docs/cluster.md), and the harder data they use
TTA_METHODS='methods=[ddp,torch_fp16,torch_powersgd,dense,fp16,topk,dgc,sidco_e,natural,qsgd,powersgd,efsignsgd,randomk,dr_bf_p0]'
TTA_DATA='overrides=["model=resnet20","data=prototypes","data.noise=3"]'

cluster_run() {  # cluster_run NAME [netbench overrides...]: results/cluster/NAME.{json,txt,png}
  local name=$1; shift
  mkdir -p "results/cluster/$(dirname "$name")"
  rm -rf "outputs/results/cluster/$name"
  gracecomm-netbench "$@" "hydra.run.dir=outputs/results/cluster/$name" \
    | tee "results/cluster/$name.txt"
  cp "outputs/results/cluster/$name/netbench.json" "results/cluster/$name.json"
  if [ -f "outputs/results/cluster/$name/accuracy_vs_time.png" ]; then
    cp "outputs/results/cluster/$name/accuracy_vs_time.png" "results/cluster/$name.png"
  fi
}

stamp() {  # stamp STEP: record on the results page the commit STEP's numbers come from
  local commit
  commit=$(git rev-parse --short=12 HEAD)
  [ -z "$(git status --porcelain --untracked-files=no -- . ':!results')" ] \
    || commit="$commit with uncommitted changes"
  sed -i "s|^<!-- stamp:$1 -->.*|<!-- stamp:$1 -->Produced at commit \`$commit\` on $(date +%F) \
by \`bash results/reproduce.sh $1\`.|" results/README.md
}

for step in "${steps[@]}"; do
  echo "=== $step"
  case $step in
    grace_benchmark) sweep grace_benchmark experiment.small.epochs=10 ;;
    sidco) sweep sidco ;;
    natural) sweep natural seed=0,1,2 ;;
    deepreduce) sweep deepreduce ;;
    deepreduce_fpr)  # the Bloom-policy grid of configs/experiment/deepreduce.yaml
      train_into deepreduce_fpr +experiment=deepreduce \
        +method=dr_bf_naive,dr_bf_p0,dr_bf_p1,dr_bf_p2 experiment.fpr=0.001,0.004,0.01,0.03
      mkdir -p results/deepreduce_fpr
      cp "$OUT/deepreduce_fpr"/report.{md,csv} "$OUT/deepreduce_fpr"/*.png results/deepreduce_fpr/ ;;
    lgc) sweep lgc
         python -m gracecomm.experiments.lgc_report "$OUT/lgc" --plot results/lgc/recon.png > results/lgc/phases.md
         python results/lgc_bound.py | tee results/lgc/bound.md ;;
    sparse_model) sweep sparse_model ;;
    every_method) sweep every_method ;;  # 75 runs: every compressor by name, seeds 0-2
    bench_sidco)
      gracecomm-bench sizes=[26214400] ratios=[0.01,0.001] \
        distributions=[laplace,student_t] gradients=[] steps=20 repeats=3 \
        hydra.run.dir=outputs/results/bench_sidco | tee results/bench_sidco.txt ;;
    sidco_bound) python results/sidco_bound.py | tee results/sidco_bound.md ;;
    bench_receive)
      gracecomm-bench 'methods=[natural,natural_dithering,standard_dithering,qsgd,terngrad,signsgd,onebit,efsignsgd]' \
        sizes=[26214400] ratios=[0.01] gradients=[] distributions=[laplace] peak_memory=false \
        repeats=9 'columns=[method,numel,compress_s,decompress_s,x_read_total,receive_x_read]' \
        hydra.run.dir=outputs/results/bench_receive | tee results/bench_receive.txt ;;
    bench_fig10)
      gracecomm-bench suite=deepreduce_fig10 hydra.run.dir=outputs/results/bench_fig10 \
        | tee results/bench_fig10.txt ;;
    natural_table1) python -m gracecomm.experiments.natural_table1 | tee results/natural_table1.txt ;;
    variance)
      gracecomm-bench suite=variance hydra.run.dir=outputs/results/variance \
        'columns=[method,data,numel,draws,second_moment,second_moment_std,variance,omega_bound,within_bound]' \
        | tee results/variance.txt ;;
    grace_reference)
      if [ -z "${GRACE_PATH:-}" ]; then
        echo "grace_reference: skipped, set GRACE_PATH to a checkout of https://github.com/sands-lab/grace" >&2
        continue
      fi
      gracecomm-bench suite=grace_reference "+grace_reference.path=$GRACE_PATH" \
        hydra.run.dir=outputs/results/grace_reference \
        'columns=[method,total_s,x_read_total,bits_per_element,grace_total_s,grace_x_read_total,grace_bits_per_element,x_faster_than_grace,skipped]' \
        | tee results/grace_reference.txt ;;
    powersgd_vs_torch) python -m gracecomm.experiments.powersgd_vs_torch | tee results/powersgd_vs_torch.txt ;;
    hook) gracecomm-bench suite=hook +hook.rounds=7 hydra.run.dir=outputs/results/hook \
        | tee results/hook.txt ;;
    long_run)  # ~2,900 steps of the default experiment: state size and peak RSS over time
      train_into long_run compressor=none,topk,dgc,sidco,powersgd,deepreduce trainer.epochs=130
      mkdir -p results/long_run && cp "$OUT/long_run"/report.{md,csv} results/long_run/
      python results/long_run.py "$OUT/long_run" | tee results/long_run/memory.md ;;
    netbench)  # needs root and iproute2: a shaped loopback in a private network namespace
      mkdir -p results/netbench
      gracecomm-netbench hydra.run.dir=outputs/results/netbench_100 | tee results/netbench/100mbit.txt
      gracecomm-netbench bandwidth_mbps=1000 hydra.run.dir=outputs/results/netbench_1000 \
        | tee results/netbench/1000mbit.txt
      gracecomm-netbench rounds=2 'methods=[ddp,dense,fp16,topk,torch_fp16]' \
        'overrides=["model=resnet20","data=prototypes","trainer.bucket_cap_mb=0.25"]' \
        hydra.run.dir=outputs/results/netbench_buckets | tee results/netbench/buckets.txt ;;
    cluster_step)  # needs root: 4 nodes, each its own 100 Mbit/s link, ranks by torchrun
      cluster_run step_4n_100mbit topology=cluster world_size=4 bandwidth_mbps=100 \
        'methods=[ddp,dense,fp16,torch_fp16,topk,powersgd,powersgd_parity,torch_powersgd]' ;;
    cluster_pinning)  # do pinned ranks steady the timings? the rounds' spread, pinned or not
      for pin in true false; do
        cluster_run "pinning/pin_${pin}" topology=cluster world_size=4 bandwidth_mbps=100 \
          pin_cpus=$pin also_sync=false rounds=5 steps=20 'methods=[ddp,topk,powersgd_parity]'
      done ;;
    cluster_model)  # the cost model at 2, 4, 8 nodes and 10, 100, 1000 Mbit/s
      for mbit in 10 100 1000; do
        for n in 2 4 8; do
          cluster_run "model/${n}n_${mbit}mbit" topology=cluster world_size=$n \
            bandwidth_mbps=$mbit also_sync=false rounds=1 steps=15 warmup_steps=5 \
            'methods=[ddp,fp16,torch_fp16,topk,dgc,randomk,powersgd_parity,torch_powersgd]'
        done
      done ;;
    cluster_tta)  # time to accuracy, 4 nodes at 10 and 100 Mbit/s
      for mbit in 10 100; do
        cluster_run "tta_4n_${mbit}mbit" topology=cluster goal=accuracy world_size=4 \
          bandwidth_mbps=$mbit "$TTA_METHODS" "$TTA_DATA"
      done ;;
    cluster_tta8)  # time to accuracy, 8 nodes at 100 Mbit/s (8 ranks on this machine's CPUs)
      cluster_run tta_8n_100mbit topology=cluster goal=accuracy world_size=8 \
        bandwidth_mbps=100 "$TTA_METHODS" "$TTA_DATA" timeout_s=1800 ;;
    cluster_collectives)  # Gloo's allreduce and allgather alone, against the model
      mkdir -p results/cluster
      python -m gracecomm.experiments.cluster_probe sweep results/cluster/collectives.json \
        --nodes 2 4 8 --mbit 10 100 1000 ;;
    cluster_projection)  # past this machine; steps to target from cluster_tta at 100 Mbit/s
      python -m gracecomm.experiments.cluster_projection results/cluster/projection.json \
        --tta results/cluster/tta_4n_100mbit.json --plot results/cluster/projection.png \
        | tee results/cluster/projection.txt ;;
    cluster_report)  # the results page's tables and the crossover plot, from the files above
      python -m gracecomm.experiments.cluster_report results/cluster | tee results/cluster/tables.md ;;
    *) echo "unknown step '$step'" >&2; exit 2 ;;
  esac
  stamp "$step"
done
