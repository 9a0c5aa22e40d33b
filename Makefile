# retr — two commands do everything on a fresh clone: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.retr-installed
DATASET ?= synthetic
DEMO_DIR ?= demo-out
PYTEST_ARGS ?=
# Python's default bytecode cache, even where the environment turns it off: pytest keeps its assertion-rewritten test
# modules there, so a second run (make test-matrix after make test) collects in 3 s instead of 11 s a process.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup test test-matrix test-gpu demo extract clean-demo options-page help

help:
	@echo "make setup                 create .venv and install retr (editable, every extra + test tools: .[dev], pinned torch)"
	@echo "make test                  run the test suite in a shuffled order (sets up first if needed)"
	@echo "make test-matrix           the numerical tests again with 2 and 4 threads (CI runs both)"
	@echo "make test-gpu              on a CUDA machine: the files whose tests take CUDA paths (record the result in docs/benchmarks.md)"
	@echo "make demo                  run every stage on the synthetic dataset and print the results table"
	@echo "make extract DATASET=coco  run every extractor of a dataset preset (coco, f30k, synthetic)"
	@echo "make options-page          rewrite docs/options.md (every command's options) after changing a command or a setting"

# The stamp is newer than pyproject.toml, setup.py and constraints.txt once installed: a second `make setup` is instant.
$(STAMP): pyproject.toml setup.py constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip>=23" "setuptools>=77"
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev]"
	@touch $(STAMP)

setup: $(STAMP)

# docs/options.md: every command's options with their help, made from the code (tests/test_options_page.py)
options-page: $(STAMP)
	$(BIN)/python tools/options_page.py

# pytest-randomly shuffles the order with a seed printed first (-q hides pytest's header): make test SEED=N
# repeats that order. pytest-xdist spreads the files over one worker per core (a file's tests stay together, so
# its module fixtures are built once); each worker runs torch on one thread (tests/conftest.py). JOBS=1: one process.
ifndef SEED
SEED := $(shell od -An -N2 -tu2 /dev/urandom | tr -d ' ')
endif
JOBS ?= auto
test: $(STAMP)
	@echo "test order: SEED=$(SEED) (make test SEED=$(SEED) repeats it)"
	$(BIN)/python -m pytest -q --randomly-seed=$(SEED) -n $(JOBS) --dist loadfile $(PYTEST_ARGS)

# A reduction's rounding depends on the thread count: every numerical test must pass with any.
test-matrix: $(STAMP)
	OMP_NUM_THREADS=2 $(BIN)/python -m pytest -q -m numerical -p no:randomly $(PYTEST_ARGS)
	OMP_NUM_THREADS=4 $(BIN)/python -m pytest -q -m numerical $(PYTEST_ARGS)

# On a machine with CUDA: every test file with a CUDA path or a device-dependent assertion (the rest of the suite
# runs the same on any device). CI has no GPU; run it whenever one is at hand and record it in docs/benchmarks.md.
GPU_TESTS := tests/test_devices.py tests/test_evaluation_devices.py tests/test_op_counts.py tests/test_similarity.py \
	tests/test_training_loop.py tests/test_search.py tests/test_search_images.py tests/test_trainer_import.py \
	tests/test_butd_batched.py tests/test_device_decode.py tests/test_extractors.py tests/test_extract.py \
	tests/test_bench_gpu.py
test-gpu: $(STAMP)
	@$(BIN)/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu: CUDA is not available here')"
	$(BIN)/python -m pytest -q -p no:randomly $(GPU_TESTS) $(PYTEST_ARGS)

# Every stage that exists, run on the synthetic dataset; each line is a command a user can copy.
demo: $(STAMP)
	@echo "== synthetic dataset =="
	$(BIN)/retr-pipeline synth --out $(DEMO_DIR)/synthetic --images 240 --seed 0
	$(BIN)/retr-pipeline manifest check $(DEMO_DIR)/synthetic/manifest.jsonl --image-root $(DEMO_DIR)/synthetic
	@echo "== image features: 5 extractors, random weights, sized for a 2-core CPU (grid and maps from a 224-px input, ten 64-px crops, regions at 224 px with 36 proposals; a re-run skips finished shards) =="
	$(BIN)/retr-pipeline extract --manifest $(DEMO_DIR)/synthetic/manifest.jsonl --image-root $(DEMO_DIR)/synthetic --extractor resnet152-grid --weights random --image-size 224 --out $(DEMO_DIR)/synthetic/features --quiet
	$(BIN)/retr-pipeline extract --manifest $(DEMO_DIR)/synthetic/manifest.jsonl --image-root $(DEMO_DIR)/synthetic --extractor vgg16-maps --weights random --image-size 224 --out $(DEMO_DIR)/synthetic/features --quiet
	$(BIN)/retr-pipeline extract --manifest $(DEMO_DIR)/synthetic/manifest.jsonl --image-root $(DEMO_DIR)/synthetic --extractor tencrop-vgg19 --weights random --image-size 64 --out $(DEMO_DIR)/synthetic/features --quiet
	$(BIN)/retr-pipeline extract --manifest $(DEMO_DIR)/synthetic/manifest.jsonl --image-root $(DEMO_DIR)/synthetic --extractor tencrop-resnet152 --weights random --image-size 64 --out $(DEMO_DIR)/synthetic/features --quiet
	$(BIN)/retr-pipeline extract --manifest $(DEMO_DIR)/synthetic/manifest.jsonl --image-root $(DEMO_DIR)/synthetic --extractor butd-regions --weights random --short-side 224 --max-side 224 --post-nms-topk 36 --pooled-size 7 --out $(DEMO_DIR)/synthetic/features --quiet
	$(BIN)/retr-pipeline verify $(DEMO_DIR)/synthetic/features/resnet152-grid.h5 $(DEMO_DIR)/synthetic/features/vgg16-maps.h5 $(DEMO_DIR)/synthetic/features/tencrop-vgg19.h5 $(DEMO_DIR)/synthetic/features/tencrop-resnet152.h5 $(DEMO_DIR)/synthetic/features/butd-regions.h5
	@echo "== referral trees =="
	$(BIN)/retr-pipeline parse-trees --manifest $(DEMO_DIR)/synthetic/manifest.jsonl --conllu $(DEMO_DIR)/synthetic/captions.conllu --out $(DEMO_DIR)/synthetic/trees.h5 --quiet
	$(BIN)/retr-pipeline show-tree --key 'synth_00000#1' --conllu $(DEMO_DIR)/synthetic/captions.conllu --dictionaries $(DEMO_DIR)/synthetic/trees.h5
	$(BIN)/retr-pipeline show-tree --key 'synth_00001#3' --conllu $(DEMO_DIR)/synthetic/captions.conllu --dictionaries $(DEMO_DIR)/synthetic/trees.h5
	@echo "== training: every model briefly from scratch on 192 images of random-weight features. Brief runs use the sum over negatives"
	@echo "   and a small lr: the published hardest-negative setting collapses this early on so little data (see README) =="
	@echo "== SCAN and VSE++ (region features from the detector with random weights) =="
	rm -rf $(DEMO_DIR)/runs/scan $(DEMO_DIR)/runs/vsepp
	$(BIN)/retr-train scan --features $(DEMO_DIR)/synthetic/features/butd-regions.h5 --manifest $(DEMO_DIR)/synthetic/manifest.jsonl --out $(DEMO_DIR)/runs/scan --epochs 6 --batch-size 32 --embed-size 256 --lr 2e-4 --sum-violation --quiet
	$(BIN)/retr-train vsepp --features $(DEMO_DIR)/synthetic/features/butd-regions.h5 --manifest $(DEMO_DIR)/synthetic/manifest.jsonl --out $(DEMO_DIR)/runs/vsepp --epochs 10 --batch-size 32 --embed-size 256 --lr 2e-4 --sum-violation --quiet
	$(BIN)/retr-train eval $(DEMO_DIR)/runs/scan --protocol f30k-1k --allow-size-mismatch --quiet
	$(BIN)/retr-train eval $(DEMO_DIR)/runs/vsepp --protocol f30k-1k --allow-size-mismatch --quiet
	@echo "== VSE∞ (the same region features pooled by GPO on both sides; brief training) =="
	rm -rf $(DEMO_DIR)/runs/vse-infinity
	$(BIN)/retr-train vse-infinity --features $(DEMO_DIR)/synthetic/features/butd-regions.h5 --manifest $(DEMO_DIR)/synthetic/manifest.jsonl --out $(DEMO_DIR)/runs/vse-infinity --epochs 6 --batch-size 32 --embed-size 256 --lr 2e-4 --sum-violation --quiet
	$(BIN)/retr-train eval $(DEMO_DIR)/runs/vse-infinity --protocol f30k-1k --allow-size-mismatch --quiet
	@echo "== SMFEA (same region features + referral trees + consensus concepts; brief training) =="
	$(BIN)/retr-pipeline build-concepts --manifest $(DEMO_DIR)/synthetic/manifest.jsonl --conllu $(DEMO_DIR)/synthetic/captions.conllu --out $(DEMO_DIR)/synthetic/concepts.h5
	rm -rf $(DEMO_DIR)/runs/smfea
	$(BIN)/retr-train smfea --features $(DEMO_DIR)/synthetic/features/butd-regions.h5 --manifest $(DEMO_DIR)/synthetic/manifest.jsonl --trees $(DEMO_DIR)/synthetic/trees.h5 --concepts $(DEMO_DIR)/synthetic/concepts.h5 --out $(DEMO_DIR)/runs/smfea --epochs 6 --batch-size 32 --embed-size 256 --lr 2e-4 --sum-violation --quiet
	$(BIN)/retr-train eval $(DEMO_DIR)/runs/smfea --protocol f30k-1k --allow-size-mismatch --quiet
	@echo "== SMAN (ResNet-152 7x7 grid, random weights, 224-px input; brief training with Adam) =="
	rm -rf $(DEMO_DIR)/runs/sman
	$(BIN)/retr-train sman --features $(DEMO_DIR)/synthetic/features/resnet152-grid.h5 --manifest $(DEMO_DIR)/synthetic/manifest.jsonl --out $(DEMO_DIR)/runs/sman --epochs 4 --batch-size 32 --embed-size 128 --word-dim 128 --optimizer adam --lr 2e-4 --grad-clip 2 --sum-violation --quiet
	$(BIN)/retr-train eval $(DEMO_DIR)/runs/sman --protocol f30k-1k --allow-size-mismatch --quiet
	@echo "== SEAM-C (ResNet-152 ten 64-px crops, random weights; brief training) =="
	rm -rf $(DEMO_DIR)/runs/seam
	$(BIN)/retr-train seam --features $(DEMO_DIR)/synthetic/features/tencrop-resnet152.h5 --manifest $(DEMO_DIR)/synthetic/manifest.jsonl --out $(DEMO_DIR)/runs/seam --text-encoder c --epochs 6 --batch-size 32 --lr 2e-4 --quiet
	$(BIN)/retr-train eval $(DEMO_DIR)/runs/seam --protocol f30k-1k --allow-size-mismatch --quiet
	@echo "== JGCAR (VGG-16 maps from random weights at 224 px: 7x7 cells; brief training, two-step evaluation) =="
	rm -rf $(DEMO_DIR)/runs/jgcar
	$(BIN)/retr-train jgcar --features $(DEMO_DIR)/synthetic/features/vgg16-maps.h5 --manifest $(DEMO_DIR)/synthetic/manifest.jsonl --out $(DEMO_DIR)/runs/jgcar --num-regions 49 --epochs 8 --batch-size 32 --embed-size 64 --word-dim 64 --hidden-size 32 --num-negatives 10 --dropout 0.1 --optimizer adam --lr 1e-3 --global-similarity cosine --shortlist 10 --sum-violation --quiet
	$(BIN)/retr-train eval $(DEMO_DIR)/runs/jgcar --protocol f30k-1k --allow-size-mismatch --quiet
	@echo "== results =="
	$(BIN)/retr-train table $(DEMO_DIR)/runs/scan $(DEMO_DIR)/runs/vsepp $(DEMO_DIR)/runs/vse-infinity $(DEMO_DIR)/runs/smfea $(DEMO_DIR)/runs/sman $(DEMO_DIR)/runs/seam $(DEMO_DIR)/runs/jgcar
	@echo "== a look at a region model (SCAN) and a grid model (SMAN): static HTML reports (numbers, curves, queries, attention) =="
	$(BIN)/retr-train show $(DEMO_DIR)/runs/scan --protocol f30k-1k --allow-size-mismatch --image-root $(DEMO_DIR)/synthetic --out $(DEMO_DIR)/report/scan --quiet
	$(BIN)/retr-train show $(DEMO_DIR)/runs/sman --protocol f30k-1k --allow-size-mismatch --image-root $(DEMO_DIR)/synthetic --out $(DEMO_DIR)/report/sman --quiet
	@echo "open $(DEMO_DIR)/report/scan/index.html and $(DEMO_DIR)/report/sman/index.html in a browser (no server needed)"
	@echo "== search the SCAN run from a web page (text → images, image → captions, attention; Ctrl-C stops it) =="
	@echo "$(BIN)/retr-train serve $(DEMO_DIR)/runs/scan --image-root $(DEMO_DIR)/synthetic"

# From nothing to features: a missing dataset is fetched (coco) or generated (synthetic: random weights, no
# network), missing weights are downloaded, then every extractor runs. Offline (RETR_OFFLINE=1) a missing
# dataset or missing weights stop it in one line naming the command to run. EXTRACT_FLAGS="--device cuda --half".
EXTRACT_FLAGS ?=
extract: $(STAMP)
	$(BIN)/retr-pipeline extract-preset $(DATASET) $(EXTRACT_FLAGS)

clean-demo:
	rm -rf $(DEMO_DIR)
