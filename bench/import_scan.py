"""Peak memory of ``import-scan``: the streaming importer against the old one (a memory map sliced in blocks).

Writes a SCAN ``train_ims.npy`` of ``--images`` × 36 × 2048 float32 (2,000 images: 563 MiB) and its captions to
a temporary folder, then imports it to float16 twice, each time in a fresh child process:

* ``streaming`` — this version's :func:`retr.pipeline.importers.import_scan` (64-image blocks read with plain
  file reads);
* baseline ``memory map`` — the ``import_scan`` of ``--baseline-ref`` (git, the commit before streaming), run as
  it was: ``np.load(mmap_mode="r")`` sliced 256 images at a time. Both write through this version's
  :class:`~retr.store.features.ShardWriter`, so the difference is the reading.

Each child reports its own peak resident set (``VmHWM`` in ``/proc/self/status``; Linux) after importing ``retr``
and after the import (``growth_mb`` is the difference: what the import itself added). ``ru_maxrss`` is not used:
Linux keeps it across ``exec``, so a child's would start at this process's size. A memory map's pages count in the resident set
once read and stay there until the map is closed, so the baseline's peak grows with the file; the streaming
importer's stays near one block whatever the size.

    .venv/bin/python bench/import_scan.py [--images 2000] [--baseline-ref f3b9165]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import json, re, subprocess, sys, time, types
    def peak_mb():  # VmHWM: ru_maxrss would start at the parent's resident size (Linux keeps it across exec)
        return int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) / 1024
    mode, data, out, repo, ref = sys.argv[1:6]
    if mode == "streaming":
        from retr.pipeline.importers import import_scan
    else:
        source = subprocess.run(["git", "-C", repo, "show", f"{ref}:pipeline/importers.py"], capture_output=True,
                                text=True, check=True).stdout
        module = types.ModuleType("retr_baseline_importers")
        sys.modules[module.__name__] = module
        exec(compile(source, f"{ref}:pipeline/importers.py", "exec"), module.__dict__)
        import_scan = module.import_scan
    before = peak_mb()
    start = time.perf_counter()
    summary = import_scan(data, out, dtype="float16")
    seconds = time.perf_counter() - start
    after = peak_mb()
    print(json.dumps({"rows": summary.rows, "seconds": seconds, "peak_rss_mb": after, "growth_mb": after - before}))
""")


def write_split(folder: Path, images: int, seed: int) -> float:
    """``train_ims.npy`` [images, 36, 2048] float32 and five captions per image; returns the file's MiB."""
    folder.mkdir(parents=True, exist_ok=True)
    array = np.lib.format.open_memmap(folder / "train_ims.npy", mode="w+", dtype=np.float32,
                                      shape=(images, 36, 2048))
    rng = np.random.default_rng(seed)
    for start in range(0, images, 100):
        stop = min(images, start + 100)
        array[start:stop] = rng.standard_normal((stop - start, 36, 2048), dtype=np.float32)
    array.flush()
    del array
    (folder / "train_caps.txt").write_text("".join(f"caption {c} of image {i}\n" for i in range(images)
                                                   for c in range(5)))
    return (folder / "train_ims.npy").stat().st_size / 2**20


def run_child(mode: str, data: Path, out: Path, ref: str) -> dict:
    result = subprocess.run([sys.executable, "-c", CHILD, mode, str(data), str(out), str(REPO), ref],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{mode} import failed:\n{result.stderr}")
    return json.loads(result.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--baseline-ref", default="f3b9165", help="git commit of the baseline importer")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="retr-bench-import-") as tmp:
        tmp = Path(tmp)
        size = write_split(tmp / "scan", args.images, args.seed)
        baseline = run_child("memory-map", tmp / "scan", tmp / "old", args.baseline_ref)
        new = run_child("streaming", tmp / "scan", tmp / "new", args.baseline_ref)
        assert new["rows"] == baseline["rows"] == args.images
        print(json.dumps({"bench": "import-scan", "what": "peak RSS of the import", "images": args.images,
                          "npy_mb": round(size, 1), "dtype": "float16",
                          "peak_rss_mb": round(new["peak_rss_mb"], 1), "growth_mb": round(new["growth_mb"], 1),
                          "seconds": round(new["seconds"], 2),
                          "baseline": f"the memory-mapped import_scan of {args.baseline_ref}",
                          "baseline_peak_rss_mb": round(baseline["peak_rss_mb"], 1),
                          "baseline_growth_mb": round(baseline["growth_mb"], 1),
                          "baseline_seconds": round(baseline["seconds"], 2),
                          "growth_vs_baseline": round(new["growth_mb"] / baseline["growth_mb"], 3)}))


if __name__ == "__main__":
    main()
