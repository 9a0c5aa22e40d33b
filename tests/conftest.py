"""Shared fixtures: small feature sets and manifests written into pytest's tmp_path, and the synthetic dataset
and tiny trained runs that many test files share (``synthetic_data``, ``synthetic_run``: made once per test
process, read-only)."""
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
# what retr remembers between commands (verified feature files, exports' search caches: retr.common.cache) likewise
os.environ["RETR_CACHE"] = __import__("tempfile").mkdtemp(prefix="retr-cache-")
__import__("atexit").register(__import__("shutil").rmtree, os.environ["RETR_CACHE"], ignore_errors=True)

#: Test files whose assertions compare computed numbers at a tolerance: `make test` runs them with 1 thread (the
#: default above), `make test-matrix` again with 2 and 4 threads (OMP_NUM_THREADS), since a reduction's order, and so its rounding, depends on the thread count.
#: Left out: test_extract (its autocast tests compare bf16/fp16 with float32 at a ~2 % tolerance, far above any
#: thread rounding, and spend ~30 s in emulated bf16 convolutions on a CPU without bf16 units).
NUMERICAL = ("test_golden_scan", "test_golden_vsepp", "test_golden_seam", "test_golden_cvse", "test_golden_butd",
             "test_golden_vse_infinity", "test_similarity", "test_evaluation", "test_gemm", "test_training_loop",
             "test_explain", "test_model_registry", "test_scan", "test_seam", "test_sman", "test_smfea", "test_jgcar",
             "test_vsepp", "test_vse_infinity", "test_butd_core", "test_butd_model", "test_butd_batched",
             "test_concepts", "test_op_counts")


#: files that take half a minute or more of one core: they start first, so that
#: `make test`'s workers (one file at a time each, pytest-xdist --dist loadfile) do not end with one of them
#: running alone. The order among the others, and among these, stays pytest-randomly's.
LONG_FILES = ("test_training_loop.py", "test_extract.py", "test_butd_batched.py", "test_training_resume.py",
              "test_golden_butd.py",       # test_training_loop: inductor's C++ compiles, ~45 s with a cold cache
              "test_coco_extended.py", "test_eval_extended.py")   # 5,000 × 25,000 matrices, ~40 s of a core each


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


# ------------------------------------------------------------------------------------ synthetic data and runs

def _copy_to(folder, destination):
    """``folder`` copied to ``destination`` (which must not exist), for a test that changes it."""
    import shutil
    from pathlib import Path

    return Path(shutil.copytree(folder, destination))


def _state(folder) -> dict:
    """Every path below ``folder`` with its size and modification time."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def _unchanged(made: dict, what: str) -> None:
    """Teardown check of the shared folders ``{folder: state when made}``: a test that wrote into one made the
    tests after it (in this process, in any order) see something else."""
    changed = {str(folder): sorted(set(_state(folder).items()) ^ set(state.items()))[:5]
               for folder, state in made.items() if _state(folder) != state}
    assert not changed, f"a test changed the shared {what} (ask for a copy with copy_to=): {changed}"


@pytest.fixture(scope="session")
def synthetic_data(tmp_path_factory):
    """``synthetic_data(images=40, seed=0)`` → ``(manifest, features)``, both paths: the synthetic dataset of
    ``tests/trainer_synthetic.py`` (:func:`make_synthetic`: ``manifest.jsonl``, ``images/``, ``scenes.jsonl``,
    ``captions.conllu`` and the scene-region feature set ``scene-regions.h5``, all in ``manifest.parent``), made
    once per test process (each xdist worker its own) for each ``(images, seed)``.

    Every test of the process that asks for the same pair gets the same files, so they are READ-ONLY: outputs go
    to the test's own ``tmp_path`` (or its module's ``tmp_path_factory`` folder), never beside the data. A test
    that changes the dataset (edits the manifest, records a hash into the features, writes a feature set beside
    them) asks for its own copy with ``copy_to=FOLDER`` (made there, FOLDER must not exist; the copy's paths are
    returned). A test process that ends with the files changed fails (at the session's teardown)."""
    from trainer_synthetic import make_synthetic

    made, states = {}, {}

    def data(images: int = 40, seed: int = 0, copy_to=None):
        if (images, seed) not in made:
            made[images, seed] = make_synthetic(tmp_path_factory.mktemp(f"synthetic-{images}-{seed}-"), images, seed)
            states[made[images, seed][0].parent] = _state(made[images, seed][0].parent)
        manifest, features = made[images, seed]
        if copy_to is None:
            return manifest, features
        folder = _copy_to(manifest.parent, copy_to)
        return folder / manifest.name, folder / features.name

    yield data
    _unchanged(states, "synthetic data")


class SyntheticRuns:
    """The factory of fixture :func:`synthetic_run` (see there)."""

    def __init__(self, synthetic_data, tmp_path_factory):
        self._data, self._folders, self._made, self._printed = synthetic_data, tmp_path_factory, {}, {}
        self.states = {}             # run folder → its state when trained (checked unchanged at the session's end)

    def __call__(self, model: str, *args, images: int = 40, data_seed: int = 0, copy_to=None):
        key = (model, tuple(map(str, args)), images, data_seed)
        if key not in self._made:
            from click.testing import CliRunner

            from retr.trainers.commands import cli

            manifest, features = self._data(images, data_seed)
            run = self._folders.mktemp(f"synthetic-run-{model}-") / model
            result = CliRunner().invoke(cli, [model, "--features", str(features), "--manifest", str(manifest), "--out",
                                              str(run), *map(str, args)], catch_exceptions=False)
            assert result.exit_code == 0, result.output
            self._made[key], self._printed[run], self.states[run] = run, result.output, _state(run)
        run = self._made[key]
        if copy_to is None:
            return run
        copy = _copy_to(run, copy_to)
        self._printed[copy] = self._printed[run]
        return copy

    def printed(self, run) -> str:
        """What training the run (or the run it is a copy of) printed."""
        return self._printed[run]


@pytest.fixture(scope="session")
def synthetic_run(synthetic_data, tmp_path_factory) -> SyntheticRuns:
    """``synthetic_run(model, *args, images=40, data_seed=0)`` → the folder (named ``model``) of the run that
    ``retr-train MODEL --features … --manifest … --out … *args`` trains on ``synthetic_data(images, data_seed)``:
    trained once per test process for each model, arguments and data (a training that fails fails the test that
    asked for it); ``synthetic_run.printed(run)`` is what the training printed.

    READ-ONLY, as the data: a test (or module fixture) that resumes the run, evaluates it (``eval`` writes
    ``eval.json`` into it), searches it (the gallery cache) or plants files in it asks for its own copy with
    ``copy_to=FOLDER`` (made there, FOLDER must not exist; the copy is returned); checked as the data is."""
    runs = SyntheticRuns(synthetic_data, tmp_path_factory)
    yield runs
    _unchanged(runs.states, "synthetic runs")
