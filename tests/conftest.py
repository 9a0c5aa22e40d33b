"""Shared fixtures: small feature sets and manifests written into pytest's tmp_path."""
from __future__ import annotations

import os

import numpy as np
import pytest
from PIL import Image

# One intra-op thread unless asked otherwise (subprocesses inherit it): the tests' tensors are tiny, and on a
# 2-core box shared with anything else two threads wait on each other at every op (measured on the 2-core box
# under load: tests/test_training_loop.py -k "ema or command_line" 27 s with 1 thread, 252 s with 2).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# torch may cap its intra-op threads at the cores it sees (4 became 2 on a 2-core box): set what was asked, so
# `make test-matrix` really runs the numerical tests with 2 and with 4 threads.
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# Tests never use the internet: retr downloads missing weights and data on first use, so every test runs offline
# (missing resources are the one-line errors) unless it serves its files itself (tests/local_server.py) and
# turns this off with monkeypatch.
os.environ["RETR_OFFLINE"] = "1"
# GloVe downloads and the word-vector caches (retr.store.word_vectors) go to a scratch folder, never ~/.cache,
# removed when this test process ends (each xdist worker has its own)
os.environ["RETR_WORD_VECTORS"] = __import__("tempfile").mkdtemp(prefix="retr-word-vectors-")
__import__("atexit").register(__import__("shutil").rmtree, os.environ["RETR_WORD_VECTORS"], ignore_errors=True)

#: Test files whose assertions compare computed numbers at a tolerance: `make test` runs them with 1 thread (the
#: default above), `make test-matrix` again with 2 and 4 threads (OMP_NUM_THREADS), since a reduction's order, and so its rounding, depends on the thread count.
#: Left out: test_extract (its autocast tests compare bf16/fp16 with float32 at a ~2 % tolerance, far above any
#: thread rounding, and spend ~30 s in emulated bf16 convolutions on a CPU without bf16 units).
NUMERICAL = ("test_golden_scan", "test_golden_vsepp", "test_golden_seam", "test_golden_cvse", "test_golden_butd",
             "test_golden_vse_infinity", "test_similarity", "test_evaluation", "test_gemm", "test_training_loop",
             "test_explain", "test_model_registry", "test_scan", "test_seam", "test_sman", "test_smfea", "test_jgcar",
             "test_vsepp", "test_vse_infinity", "test_butd_core", "test_butd_model", "test_butd_batched",
             "test_concepts")


#: files that take half a minute or more of one core: they start first, so that
#: `make test`'s workers (one file at a time each, pytest-xdist --dist loadfile) do not end with one of them
#: running alone. The order among the others, and among these, stays pytest-randomly's.
LONG_FILES = ("test_training_loop.py", "test_extract.py", "test_butd_batched.py", "test_training_resume.py",
              "test_golden_butd.py")       # test_training_loop: inductor's C++ compiles, ~45 s with a cold cache


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name.startswith(NUMERICAL):
            item.add_marker(pytest.mark.numerical)


class _LongFilesFirst:
    @pytest.hookimpl(trylast=True)                  # after pytest-randomly's shuffle and -m's deselection
    def pytest_collection_modifyitems(self, items):
        items.sort(key=lambda item: item.path.name not in LONG_FILES)   # stable: the shuffle stays within each


def pytest_configure(config):
    config.pluginmanager.register(_LongFilesFirst(), "retr-long-files-first")


def grid_attrs(**overrides):
    attrs = dict(kind="grid", extractor="resnet152-grid", backbone="resnet152", weights="random",
                 image_size=448, manifest_sha256="0" * 64)
    attrs.update(overrides)
    return attrs


@pytest.fixture
def noise_jpegs(tmp_path):
    """``make([(w, h), …])`` writes ``img0.jpg``, ``img1.jpg``, … of uniform RGB noise (one seeded generator, in
    order; quality 95) into tmp_path and returns their paths."""
    def make(sizes):
        rng = np.random.default_rng(0)
        paths = []
        for k, (w, h) in enumerate(sizes):
            path = tmp_path / f"img{k}.jpg"
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB").save(path, quality=95)
            paths.append(path)
        return paths
    return make


@pytest.fixture
def make_feature_set(tmp_path):
    """Write a sharded grid feature set; returns (index path, {id: features}) for checking reads."""
    from retr.store.features import ShardWriter, shard_name, write_index

    def make(num_shards=3, rows_per_shard=4, shape=(49, 2048), dtype="float16", name="resnet152-grid",
             attrs=None, seed=0):
        rng = np.random.default_rng(seed)
        folder = tmp_path / "features" / name
        expected, paths = {}, []
        for s in range(num_shards):
            path = folder / shard_name(s, num_shards)
            with ShardWriter(path, attrs or grid_attrs(extractor=name), shape, dtype=dtype, shard_index=s,
                             num_shards=num_shards) as writer:
                ids = [f"img_{s}_{i}" for i in range(rows_per_shard)]
                features = rng.standard_normal((rows_per_shard, *shape)).astype(np.float32)
                writer.append(ids, features)
                writer.add_error(f"broken_{s}", "cannot identify image file")
                expected.update(zip(ids, features))
            paths.append(path)
        index = write_index(folder.with_name(name + ".h5"), paths)
        return index, expected

    return make


def in_memory_features(array: np.ndarray, num_boxes=None):
    """``array`` [N, K, D] as the evaluator's ``ImageFeatures`` (rows in order, ``num_boxes`` [N] real rows each,
    default all K), without a store: for tests of scoring (the store path is tested in test_trainer_data)."""
    from retr.trainers.data.splits import ImageFeatures
    features = ImageFeatures.__new__(ImageFeatures)
    features._memory, features.feature_shape = array, array.shape[1:]
    features.num_boxes = np.full(len(array), array.shape[1]) if num_boxes is None else np.asarray(num_boxes)
    features.rows = np.arange(len(array))
    return features


class CliRunnerHelper:
    """Runs ``retr-pipeline``/``retr-train`` commands for tests (the one CLI helper; fixture :func:`run_cli`).

    * ``run_cli("train", "scan", "--out", …)`` — in-process through click's runner; asserts the exit code is 0
      (or non-zero with ``ok=False``) and returns click's result;
    * ``run_cli.as_user("pipeline", …)`` — in-process through the console scripts' entry point
      (:func:`retr.common.cli.run`: one-line errors, exit codes), returns ``(exit code, stdout, stderr)``;
    * ``run_cli.console_script("retr-pipeline", …)`` — the installed script in a subprocess (exactly what a
      user's shell sees), returns the ``CompletedProcess``.
    """

    @staticmethod
    def _group(program: str):
        if program == "train":
            from retr.trainers.commands import cli
        elif program == "pipeline":
            from retr.pipeline.commands import cli
        else:
            raise ValueError(f"program must be 'train' or 'pipeline', not {program!r}")
        return cli

    def __call__(self, program: str, *args, ok: bool = True):
        from click.testing import CliRunner

        result = CliRunner().invoke(self._group(program), [str(a) for a in args])
        if ok:
            assert result.exit_code == 0, result.output
        else:
            assert result.exit_code != 0, result.output
        return result

    def as_user(self, program: str, *args) -> tuple[int, str, str]:
        import contextlib
        import io

        from retr.common.cli import run

        out, err = io.StringIO(), io.StringIO()
        code = 0
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                run(self._group(program), [str(a) for a in args])
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        return code, out.getvalue(), err.getvalue()

    @staticmethod
    def console_script(name: str, *args, cwd=None):
        import subprocess
        import sys
        from pathlib import Path

        return subprocess.run([str(Path(sys.executable).parent / name), *map(str, args)], capture_output=True,
                              text=True, cwd=cwd)


@pytest.fixture
def run_cli() -> CliRunnerHelper:
    """The CLI helper (:class:`CliRunnerHelper`)."""
    return CliRunnerHelper()
