#!/usr/bin/env bash
# The device check: run it whenever a GPU is lent (under 8 minutes on one GPU), and record the
# card's name with the figures (BENCHMARKS.md). Writes one JSON object (--out, default
# workdirs/gpu_check.json): the card, then one entry per section, each the last JSON line of
# its command (or its error).
#
#   bash scripts/gpu_check.sh                 # on the GPU host
#   bash scripts/gpu_check.sh --dry-run       # CPU, tiny shapes: checks the script itself
#
# Sections: train step MFU at Qwen3-0.6B shapes (scripts/train_mfu.py: random weights, bf16,
# remat full, chunked
# logits); decode tokens/s at batch 1 and 32 (benchmarks/decode.py), the role switch
# (benchmarks/switch.py), the path cap (benchmarks/path_cap.py), the memory plan of
# experiments/qwen3_code.py (python -m gyre.plan). The tree schedule is not built yet.
set -u
cd "$(dirname "$0")/.."
DRY=0
OUT=workdirs/gpu_check.json
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out) OUT="$2"; shift ;;
    *) echo "usage: bash scripts/gpu_check.sh [--dry-run] [--out FILE]"; exit 2 ;;
  esac
  shift
done
mkdir -p "$(dirname "$OUT")"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
if [ "$DRY" = 1 ]; then
  export JAX_PLATFORMS=cpu
  LIMIT=300
else
  LIMIT=150
fi
PY=${PYTHON:-python}

run() {  # name, then the command: its last JSON line goes to $TMP/name.json
  local name=$1; shift
  local start=$SECONDS
  echo "== $name: $*" >&2
  if timeout "$LIMIT" "$@" >"$TMP/$name.log" 2>"$TMP/$name.err"; then
    tail -n 1 "$TMP/$name.log" >"$TMP/$name.json"
    tail -n 12 "$TMP/$name.log" | head -n 11 >&2
  else
    local rc=$?
    local why
    why=$(tail -n 1 "$TMP/$name.err" | tr -d '"\\')
    echo "{\"error\": \"exit $rc: $why\"}" >"$TMP/$name.json"
    echo "   failed (exit $rc): $why" >&2
  fi
  echo "   $((SECONDS - start)) s" >&2
}

if [ "$DRY" = 1 ]; then
  run train_mfu "$PY" scripts/train_mfu.py --dry-run
  run decode "$PY" benchmarks/decode.py --quick --no-load --batches 1
  run switch "$PY" benchmarks/switch.py --repeats 1 --vocab 256 --d-model 64 --layers 1 \
    --d-ff 128 --heads 2 --kv-heads 1 --head-dim 32
  run path_cap "$PY" benchmarks/path_cap.py --quick --runs 1 --executions 2
  run plan "$PY" -m gyre.plan --config=experiments/qwen3_code.py:tiny --device_memory=80GB --json
else
  run train_mfu "$PY" scripts/train_mfu.py
  run decode "$PY" benchmarks/decode.py --model peer --no-load
  run switch "$PY" benchmarks/switch.py --devices 1 --cell-size 1
  run path_cap "$PY" benchmarks/path_cap.py
  run plan "$PY" -m gyre.plan --config=experiments/qwen3_code.py --shapes=qwen3-0.6b \
    --device_memory=80GB --config.train.remat=full --json
fi

"$PY" - "$TMP" "$OUT" "$DRY" <<'EOF'
import glob, json, os, subprocess, sys
tmp, out, dry = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
try:
    card = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=20).stdout.strip()
except (OSError, subprocess.SubprocessError):
    card = ""
result = {"card": card or "none (CPU)", "dry_run": dry}
for path in sorted(glob.glob(os.path.join(tmp, "*.json"))):
    name = os.path.basename(path)[:-5]
    text = open(path).read().strip()
    try:
        result[name] = json.loads(text)
    except json.JSONDecodeError:
        result[name] = {"error": f"no JSON line: {text[:200]}"}
with open(out, "w") as f:
    json.dump(result, f, indent=1, sort_keys=True)
print(json.dumps(result, sort_keys=True))
EOF
