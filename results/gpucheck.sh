#!/usr/bin/env bash
# The GPU readiness check (docs/gpu.md) in one short call of a machine with a GPU and no
# network: it finds or installs what the check needs, runs `gracecomm-gpucheck` on CUDA and
# leaves its report in $OUT: gpucheck.md, gpucheck.json, gpucheck.log, environment.txt.
#
#   bash results/gpucheck.sh --prepare   # where pip reaches a registry: the pure-Python
#                                         # wheels a bare GPU image lacks, into .whl/
#   bash results/gpucheck.sh              # on the GPU machine (copy of the working tree, with
#                                         # .whl/ carried along); target: under 5 minutes on
#                                         # an H100 (not yet measured)
#   bash results/gpucheck.sh device=cpu sizes=[65536] ddp.methods=[none]   # a dry run here
#
# Further arguments go to gracecomm-gpucheck. Without $OUT the report goes to
# outputs/gpucheck-sh/ (never over the stored one); store a GPU run's four files in
# results/gpucheck/. Exit status: gracecomm-gpucheck's (0 passed, 1 a check failed, 2 no
# CUDA), 124 when it ran past GPUCHECK_LIMIT_S (default 480 s), 3 when something it needs is
# missing (the message says what and how to bring it).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
WHEELS=.whl
LIMIT_S=${GPUCHECK_LIMIT_S:-480}
OUT=${OUT:-outputs/gpucheck-sh}
mkdir -p "$OUT"
LOG=$OUT/gpucheck.log
: >"$LOG"

say() { echo "gpucheck.sh: $*" | tee -a "$LOG" >&2; }
die() { say "$*"; exit 3; }

version() { "$PY" -m pip show "$1" 2>/dev/null | awk '/^Version:/ {print $2}'; }

if [ "${1:-}" = "--prepare" ]; then
  # The project's dependencies that the GPU image lacks are pure Python: build their wheels
  # at the versions installed here (antlr4's is built from its source distribution).
  specs=()
  for pkg in hydra-core omegaconf antlr4-python3-runtime; do
    v=$(version "$pkg")
    [ -n "$v" ] || die "$pkg is not installed here; install the project first (pip install -e .)"
    specs+=("$pkg==$v")
  done
  mkdir -p "$WHEELS"
  "$PY" -m pip wheel -q --no-deps -w "$WHEELS" "${specs[@]}"
  ls "$WHEELS"
  echo "carry $WHEELS to the GPU machine (device run: carry=[\"$WHEELS\"])"
  exit 0
fi

# 1. torch: the machine's own if it imports, else the pinned CPU/CUDA wheel from a registry.
if ! "$PY" -c "import torch" 2>>"$LOG"; then
  say "torch does not import with $PY; trying pip install torch==2.13.0"
  "$PY" -m pip install -q torch==2.13.0 >>"$LOG" 2>&1 \
    || die "torch is missing and pip could not install torch==2.13.0 (no registry?); run on a machine whose python3 has torch, or set PYTHON"
fi

# 2. carried wheels (bash results/gpucheck.sh --prepare) go to a private folder on the path.
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  SITE=/tmp/gpucheck-site
  rm -rf "$SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl \
    >>"$LOG" 2>&1 || die "the wheels in $WHEELS did not install (see $LOG)"
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi

missing() {  # the project's dependencies that do not import
  "$PY" - <<'EOF'
import importlib
need = ["hydra", "omegaconf", "numpy", "scipy", "sklearn", "numba", "tqdm", "yaml"]
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))
EOF
}
lacking=$(missing)
if [ -n "$lacking" ]; then
  say "missing: $lacking; trying pip install -e . (with its dependencies)"
  "$PY" -m pip install -q -e . >>"$LOG" 2>&1 || die "missing Python packages: $lacking. \
Where pip reaches a registry run 'bash results/gpucheck.sh --prepare' and carry $WHEELS/ \
(hydra-core, omegaconf, antlr4-python3-runtime); numpy, scipy, scikit-learn, numba, tqdm and \
PyYAML must be on the machine"
  lacking=$(missing)
  [ -z "$lacking" ] || die "still missing after pip install: $lacking"
fi

# 3. this working tree as `gracecomm`: an editable install without fetching a build backend,
# else a folder of links that maps the top-level folders as pyproject.toml does.
ours() {
  "$PY" -c "import gracecomm, pathlib, sys; \
sys.exit(0 if pathlib.Path(gracecomm.__file__).resolve().is_relative_to('$ROOT') else 1)" \
    2>/dev/null
}
if ! ours; then
  if ! "$PY" -m pip install -q --no-deps --no-build-isolation -e . >>"$LOG" 2>&1 || ! ours; then
    say "pip could not install the project (old setuptools?); linking it onto the path"
    LINKS=/tmp/gpucheck-src
    rm -rf "$LINKS" && mkdir -p "$LINKS/gracecomm"
    for f in grace/*; do ln -s "$ROOT/$f" "$LINKS/gracecomm/"; done
    for d in compressors memories communicators experiments configs; do
      ln -s "$ROOT/$d" "$LINKS/gracecomm/$d"
    done
    export PYTHONPATH=$LINKS${PYTHONPATH:+:$PYTHONPATH}
    ours || die "gracecomm does not import from $ROOT (see $LOG)"
  fi
fi

# 4. what ran where, then the check (bounded, so that its log comes back even if it hangs).
{
  echo "date: $(date -u +%FT%TZ)"
  echo "commit: $(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)$( \
    [ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] || echo ' with changes')"
  "$PY" - <<'EOF'
import importlib.metadata as md, platform, torch
print("python:", platform.python_version(), "torch:", torch.__version__, "cuda:",
      torch.version.cuda, "gpus:", torch.cuda.device_count())
for name in ("numpy", "numba", "scipy", "hydra-core", "omegaconf"):
    try:
        print(f"{name}: {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name}: not found")
EOF
  nvidia-smi 2>&1 || echo "nvidia-smi: not available"
} >"$OUT/environment.txt" 2>&1

RUN=/tmp/gpucheck-run
rm -rf "$RUN"
set +e
PYTHONUNBUFFERED=1 timeout "$LIMIT_S" "$PY" -m gracecomm.experiments.checks.gpucheck \
  "hydra.run.dir=$RUN" "$@" 2>&1 | tee -a "$LOG"
status=${PIPESTATUS[0]}
set -e
for f in gpucheck.md gpucheck.json; do
  [ -f "$RUN/$f" ] && cp "$RUN/$f" "$OUT/"
done
[ "$status" -ne 124 ] || say "the check ran past $LIMIT_S s and was stopped (GPUCHECK_LIMIT_S)"
say "exit status $status; report in $OUT"
exit "$status"
