"""Pack what the GPU head training (issue 24 item 4) needs for the device machine, in calls that fit its limits.

The device call carries at most 64 MiB (the repository's tracked files included, ~30 MB) and has no package
registry; the target (the SmolLM2 GGUF, ~98 MB) and the ShareGPT package (~120 MB) do not fit one call. This
writes, under the ignored folder .carry/gpu_train/:

    p0/ p1/ ... pN/   the GGUF in pieces (each call carries one: the machine keeps what earlier calls left
                      while it stays warm, ~30 s between calls), the last piece with the gguf package (pure
                      Python), the prompts (ShareGPT conversations, train and held-out split kept by id,
                      gzipped JSON: train.pipeline's `sharegpt` and `sharegpt-turns` sources read them),
                      the pieces' SHA-256; with --replies, reply parts the target
                      generated elsewhere, in whichever calls have room (pK/replies/<k>.tar.gz:
                      gpu_train_run.sh unpacks each for train.pipeline --replies-from)
    commands.txt      the device calls, in order: every call but the last only carries its piece; the last
                      runs benchmarks/gpu_train_run.sh (reassemble, check, build, train.pipeline --device cuda)

    python benchmarks/gpu_train_stage.py [--train-prompts 40000] [--replies runs/cpu_replies/replies ...]

The reply parts let the CPU's spare sessions feed the GPU's training: `python -m train.pipeline --device cpu`
on prompts the GPU runs do not reach (--skip-prompts; killed whenever, its whole parts kept) generates them.
And earlier GPU sessions' own: gpu_train_run.sh returns its run's parts (replies.tar.gz.NN; unpack them with
`cat replies.tar.gz.* | tar xz -C runs/gpu_replies/sNN`), so each GPU session trains on all the data so far.

Then, with the device tool: one `run` per line of commands.txt, each naming its carry, back to back.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LIMIT = 64 << 20          # bytes one device call carries, working tree included
SLACK = 2 << 20           # untracked files, rounding, the transfer's own overhead


def tracked_bytes() -> int:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return sum((ROOT / f).stat().st_size for f in files.decode().split("\0") if f and (ROOT / f).is_file())


def write_prompts(path: Path, train: int, heldout: int, source: str | None = None) -> dict:
    """`train` + `heldout` conversations (ids kept, so the split is the package's; source: a ShareGPT file
    instead of the package's): a train conversation up to its last turn the `sharegpt-turns` source keeps
    (its first user turn alone if none), a held-out one's first user turn. Either source reads this file as
    it reads the package, prompt for prompt."""
    from train.data import later_turns, sharegpt_conversations
    convs, counts = [], {}
    for split, n in (("train", train), ("heldout", heldout)):
        for i, (cid, msgs) in enumerate(sharegpt_conversations(split, source)):
            if i == n:
                break
            turns = later_turns(msgs) if split == "train" else []
            kept = turns[-1] if turns else msgs[:1]
            convs.append({"id": cid, "conversations": [{"from": "human" if m["role"] == "user" else "gpt",
                                                        "value": m["content"]} for m in kept]})
        counts[split] = len(convs) - sum(counts.values())
    with gzip.open(path, "wt", compresslevel=9) as f:
        json.dump(convs, f)
    return {**counts, "bytes": path.stat().st_size}


def pack_replies(dirs: list[Path], folder: Path) -> None:
    """Each directory's reply parts gzipped into folder/<k>.tar.gz (the parts at the archive's top, for
    gpu_train_run.sh to unpack into a directory of its own): token ids compress ~7x, and one GPU session's
    parts (~50 MB) would not fit a call raw. ValueError for a directory without parts."""
    for k, d in enumerate(dirs):
        parts = sorted(Path(d).glob("part_*.safetensors"))
        if not parts:
            raise ValueError(f"--replies {d}: no reply parts (part_*.safetensors) there")
        folder.mkdir(parents=True, exist_ok=True)
        with tarfile.open(folder / f"{k}.tar.gz", "w:gz") as t:
            for f in parts:
                t.add(f, arcname=f.name)


def plan_calls(gguf: int, tars: list[int], last: int, room: int) -> tuple[list[tuple[int, int]], list[int]]:
    """How the calls share the load, each carrying at most `room` bytes: the GGUF (`gguf` bytes, cut anywhere),
    the reply archives (sizes `tars`, whole) and `last` bytes that ride the last call (prompts, the gguf
    package, the manifest). The fewest calls: archives first-fit, largest first, then the GGUF in order into
    what each call has left. -> (the GGUF's [start, end) byte range per call, each archive's call).
    ValueError when one archive alone does not fit a call."""
    if room <= last + (1 << 20) or any(t > room for t in tars):
        raise ValueError(f"a call carries {room} bytes beside the repository: too little for the prompts "
                         f"({last} bytes) and the largest reply archive ({max(tars, default=0)} bytes)")
    n = max(1, -(-(gguf + sum(tars) + last) // room))
    while True:
        free = [room] * (n - 1) + [room - last]
        homes = [0] * len(tars)
        for i in sorted(range(len(tars)), key=lambda i: -tars[i]):
            k = next((k for k in range(n) if free[k] >= tars[i]), None)
            if k is None:
                break
            free[k] -= tars[i]
            homes[i] = k
        else:
            if sum(free) >= gguf:
                cuts, start = [], 0
                for k in range(n):
                    end = gguf if k == n - 1 else min(gguf, start + free[k])
                    cuts.append((start, end))
                    start = end
                return cuts, homes
        n += 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="registry name or .gguf path")
    p.add_argument("--train-prompts", type=int, default=40000)
    p.add_argument("--heldout-prompts", type=int, default=400)
    p.add_argument("--out", type=Path, default=ROOT / ".carry" / "gpu_train")
    p.add_argument("--replies", type=Path, nargs="*", default=[], metavar="DIR",
                   help="reply directories (a train.pipeline run's <out>/replies) the GPU run trains on too")
    args = p.parse_args()

    from engine.loader import resolve_model
    src = resolve_model(args.model)
    if src.kind != "gguf":
        sys.exit(f"gpu_train_stage: {args.model} is not a GGUF model")
    spec = importlib.util.find_spec("gguf")
    if spec is None or spec.origin is None:
        sys.exit("gpu_train_stage: the gguf package is not installed here (pip install gguf)")
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    extras = args.out / "extras"
    extras.mkdir()
    prompts = write_prompts(extras / "sharegpt_prompts.json.gz", args.train_prompts, args.heldout_prompts)
    shutil.copytree(Path(spec.origin).parent, extras / "site" / "gguf",
                    ignore=shutil.ignore_patterns("__pycache__"))
    # its metadata too: transformers parses the installed gguf's version and fails on none ('N/A')
    version = importlib.metadata.version("gguf")
    meta = extras / "site" / f"gguf-{version}.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: gguf\nVersion: {version}\n")
    (meta / "RECORD").write_text("")
    try:
        pack_replies(args.replies, extras / "replies")
    except ValueError as e:
        sys.exit(f"gpu_train_stage: {e}")
    tars = sorted(extras.glob("replies/*.tar.gz"))
    last_bytes = sum(f.stat().st_size for f in extras.rglob("*") if f.is_file() and f not in tars)
    room = LIMIT - tracked_bytes() - SLACK
    data = src.path.read_bytes()
    try:
        cuts, homes = plan_calls(len(data), [t.stat().st_size for t in tars], last_bytes, room)
    except ValueError as e:
        sys.exit(f"gpu_train_stage: {e}")
    n = len(cuts)
    for k, (start, end) in enumerate(cuts):
        d = args.out / f"p{k}"
        (d / "replies").mkdir(parents=True)
        (d / f"{src.path.name}.{k}").write_bytes(data[start:end])
    for t, k in zip(tars, homes):
        shutil.move(str(t), args.out / f"p{k}" / "replies" / t.name)
    last = args.out / f"p{n - 1}"
    shutil.move(str(extras / "sharegpt_prompts.json.gz"), last / "sharegpt_prompts.json.gz")
    shutil.move(str(extras / "site"), last / "site")
    shutil.rmtree(extras)
    manifest = {"gguf": src.path.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                "pieces": n, "prompts": prompts, "replies": [str(d) for d in args.replies]}
    (last / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")

    lines = [f"carry .carry/gpu_train/p{k}   command: ls -la .carry/gpu_train" for k in range(n - 1)]
    lines.append(f"carry .carry/gpu_train/p{n - 1}   command: bash benchmarks/gpu_train_run.sh")
    (args.out / "commands.txt").write_text("\n".join(lines) + "\n")
    for k in range(n):
        size_k = sum(f.stat().st_size for f in (args.out / f"p{k}").rglob("*") if f.is_file())
        print(f"p{k}: {size_k / 1e6:.1f} MB")
    print(f"room a call: {room / 1e6:.1f} MB; prompts: {prompts}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
