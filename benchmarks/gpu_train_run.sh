#!/usr/bin/env bash
# The last device call of a GPU head training (issue 24 item 4), after benchmarks/gpu_train_stage.py's pieces
# have arrived in .carry/gpu_train/p*: reassemble and check the target GGUF, build the extension (and check that
# C++ error messages raise, tests/test_bad_args_subprocess.py), then train.pipeline on the GPU, starting from
# the shipped head, on ShareGPT prompts the target answers itself. What comes back under $OUT: the exported head
# (model.safetensors in pieces under 16 MiB: `cat head.safetensors.* > model.safetensors`), its config.json,
# eval.json, the logs (logs.tar.gz) and the run's replies (`cat replies.tar.gz.* | tar xz`: a replies/ folder
# of whole parts, for gpu_train_stage.py --replies in later sessions).
#
#   bash benchmarks/gpu_train_run.sh      # env: TRAIN_MIN (default 5), DEVICE (cuda), SKIP_BUILD=1, SKIP_TESTS=1,
#                                         # SOURCE (sharegpt: first turns; sharegpt-turns: later turns; topics: questions about the world),
#                                         # SKIP_PROMPTS (default 0: of SOURCE's), REPLIES_SHARE (default 0.45),
#                                         # TRAIN_ARGS (more train.pipeline flags, e.g. --num-prompts 0)
#
# Reply parts staged with gpu_train_stage.py --replies (the CPU's, from earlier sessions) are trained on
# beside the run's own (train.pipeline --replies-from).
#
# Each GPU session continues from the shipped head on prompts no earlier session answered: SKIP_PROMPTS is the
# sum of the earlier runs' eval.json `replies.prompts` (benchmarks/RESULTS.md, "GPU" -> head training, lists
# them). On a GPU a reply token costs more than an epoch's training on it (RESULTS.md), and data volume is what
# lifts acceptance, so the replies get a larger share of the budget than train.pipeline's default.
#
# A session's last few minutes of device time can still gather replies for later sessions: a call with
# TRAIN_MIN=1.5 REPLIES_SHARE=0.84 SKIP_TESTS=1 TRAIN_ARGS="--steps 1 --eval-prompts 1 --eval-tokens 8" spends
# ~76 s answering prompts and returns the parts (~1.6M reply tokens on an H200; the head it trains for one step
# is not for shipping). Add SKIP_BUILD=1 on a machine still warm from an earlier build (~65 s saved).
#
# Sized for a 600 s device command: build ~60 s, the bad-argument tests ~30 s, train.pipeline's stages TRAIN_MIN
# minutes plus loading and evaluation (killed 150 s past its budget or CALL_LIMIT (590) s into the call, whichever
# comes first, after which its last export is used).
set -u
OUT=${OUT:-/tmp/gpu_train}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} PYTHONDONTWRITEBYTECODE=1
PY=${PY:-python3}
STAGE=.carry/gpu_train
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }

target=$($PY - "$STAGE" <<'EOF'
import hashlib, json, sys
from pathlib import Path
stage = Path(sys.argv[1])
manifests = sorted(stage.glob("p*/manifest.json"))
if not manifests:
    sys.exit(f"gpu_train_run: no manifest under {stage}: run benchmarks/gpu_train_stage.py and carry every piece")
m = json.loads(manifests[0].read_text())
parts = [stage / f"p{k}" / f"{m['gguf']}.{k}" for k in range(m["pieces"])]
missing = [str(p) for p in parts if not p.exists()]
if missing:
    sys.exit(f"gpu_train_run: missing {missing} (each earlier call must carry its piece, back to back)")
data = b"".join(p.read_bytes() for p in parts)
if hashlib.sha256(data).hexdigest() != m["sha256"]:
    sys.exit("gpu_train_run: the reassembled GGUF's SHA-256 differs from the manifest's")
out = Path("/tmp") / m["gguf"]
out.write_bytes(data)
print(out)
EOF
) || exit 2
last=$(dirname "$(ls $STAGE/p*/manifest.json | head -1)")
export PYTHONPATH="$PWD/$last/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
stamp "target $target"

if [ "${SKIP_BUILD:-0}" != 1 ]; then
    arch=$($PY -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
    TORCH_CUDA_ARCH_LIST=$arch timeout 150 $PY setup.py build_ext --inplace >"$OUT/build.log" 2>&1
    stamp "build rc=$?"
    if [ "${SKIP_TESTS:-0}" != 1 ]; then
        timeout 60 $PY -m pytest -q -n 4 -p no:cacheprovider tests/test_bad_args_subprocess.py >"$OUT/bad_args.log" 2>&1
        stamp "bad-argument tests rc=$? $(tail -1 "$OUT/bad_args.log")"
    fi
fi

run=/tmp/gpu_train_run
rm -rf "$run"
from=()  # reply parts generated elsewhere (gpu_train_stage.py --replies, gzipped): trained on beside the run's own
for t in "$STAGE"/p*/replies/*.tar.gz; do  # whichever call carried each
    [ -f "$t" ] || continue
    d=/tmp/gpu_train_replies/$(basename "$t" .tar.gz)
    rm -rf "$d" && mkdir -p "$d" && tar xzf "$t" -C "$d" || exit 2
    from+=(--replies-from "$d")
done
stamp "replies from elsewhere: $(( ${#from[@]} / 2 )) directories"
minutes=${TRAIN_MIN:-5}
# killed 150 s past its budget, or sooner where the device call would end first (CALL_LIMIT seconds from this
# script's start, 25 s kept for what follows): then its last export (every --save-every steps) comes back
left=$(( ${CALL_LIMIT:-590} - ($(date +%s) - t0) - 25 ))
timeout "$($PY -c "print(max(1, min(int(float('$minutes') * 60) + 150, $left)))")" $PY -m train.pipeline --out "$run" --device "${DEVICE:-cuda}" \
    --model "$target" --sharegpt "$last/sharegpt_prompts.json.gz" --init engine/heads/smollm2-135m-eagle3 --draft-vocab 8192 \
    --source "${SOURCE:-sharegpt}" --minutes "$minutes" --skip-prompts "${SKIP_PROMPTS:-0}" --replies-share "${REPLIES_SHARE:-0.45}" \
    "${from[@]}" --quiet ${TRAIN_ARGS:-} >"$OUT/train.log" 2>&1
stamp "train.pipeline rc=$?"
tail -40 "$OUT/train.log"
head_dir=$run/train/head
if [ -f "$head_dir/model.safetensors" ]; then
    split -b 15M -d "$head_dir/model.safetensors" "$OUT/head.safetensors."
    cp "$head_dir/config.json" "$OUT/"
fi
if [ -f "$run/eval.json" ]; then  # its gist (the whole file comes back too)
    cp "$run/eval.json" "$OUT/"
    $PY - "$run/eval.json" <<'EOF'
import json, sys
e = json.load(open(sys.argv[1]))
r, t = e.get("replies", {}), e.get("train", {})
print("replies:", {k: r.get(k) for k in ("prompts", "sequences", "reply_tokens", "seconds")},
      "staged:", sum(v["reply_tokens"] for v in r.get("from", {}).values()))
print("train:", {k: t.get(k) for k in ("steps", "seconds")}, "split (s):", (t.get("last") or {}).get("split"),
      "last acc:", (t.get("last") or {}).get("acc"))
print("n-alpha:", e.get("n_alpha"), "chain tau:", e.get("chain", {}).get("tau"),
      "tree tau:", e.get("tree", {}).get("tau"))
m = e.get("mt_bench_style", {})
print("MT-bench-style n-alpha:", m.get("n_alpha"), "chain accept len:", m.get("n_alpha_chain_accept_len"),
      "first step by category:", m.get("first_step_by_category"))
EOF
fi
logs=$(cd "$OUT" && ls build.log bad_args.log train.log 2>/dev/null)  # one file: a call returns at most 8
[ -n "$logs" ] && tar -C "$OUT" -czf "$OUT/logs.tar.gz" $logs && (cd "$OUT" && rm -f $logs)
# The run's own replies come back too (replies.tar.gz.NN: `cat replies.tar.gz.* | tar xz` gives replies/),
# so that later GPU sessions train on every earlier session's data (gpu_train_stage.py --replies), not only
# on their own: as many whole parts as fit beside the rest in what a call returns (8 files, 64 MiB in all).
$PY - "$run/replies" "$OUT" <<'EOF'
import io, sys, tarfile
from pathlib import Path
src, out = Path(sys.argv[1]), Path(sys.argv[2])
every = sorted(src.glob("part_*.safetensors"))
files = list(out.iterdir())
room = min((62 << 20) - sum(f.stat().st_size for f in files), (8 - len(files)) * (15 << 20))
parts, data = every, b""
while parts and room > 0:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for f in parts:
            t.add(f, arcname=f"replies/{f.name}")
    if buf.tell() <= room:
        data = buf.getvalue()
        break
    parts = parts[:int(len(parts) * room / buf.tell() * 0.95)]
for k in range(0, len(data), 15 << 20):
    (out / f"replies.tar.gz.{k // (15 << 20):02d}").write_bytes(data[k:k + (15 << 20)])
print(f"replies back: {len(parts) if data else 0} of {len(every)} parts, {len(data)} bytes")
EOF
stamp "done"
