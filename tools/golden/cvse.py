"""Golden figures of CVSE's code (``BruceW91/CVSE``) for the parts of SMFEA that retr takes from it.

Run by hand, never by CI, from the repository root, with a checkout of the authors' repository (only its code
is read; the large data files it tracks are not needed)::

    git clone https://github.com/BruceW91/CVSE /tmp/authors/CVSE
    .venv/bin/python tools/golden/cvse.py /tmp/authors/CVSE

It writes ``tests/data/golden/cvse/`` (``tools/golden/common.py``), which ``tests/test_golden_cvse.py`` reads.

What runs is CVSE's own ``CVSE`` object (``model_CVSE.py``) with its own graph code (``util/util_C_GCN.py``,
``util/C_GCN.py``), on the CPU in float64, in the configuration of its Flickr30K run (``train_f30k.py``:
``use_BatchNorm``, ``tanh``, ``weight_sum`` fusion with ``fuse_weight`` 0.85, bi-GRU, hardest negatives, margin
0.2, ``Concept_label_ratio`` 0.35, loss weights 3/5/1/2, ``t`` = 0.3 and the ``Complex`` graph) at tiny sizes
(embedding 16, regions 36 × 8, words 6, 12 concepts with 10-d input vectors, vocabulary 20, batch 6) and with
``dropout_rate`` 0, since dropout masks cannot be matched across two implementations. The initial state (every
parameter and batch-norm statistic the forward pass uses), the concept co-occurrence counts and the batches are
drawn here from a seeded NumPy generator and stored in ``inputs.npz``; both sides start from them. CVSE keeps
the un-normalised graph as a float32 parameter (``.float()`` in ``C_GCN.__init__``); like every other parameter,
it is set to its float64 value (``gen_A_concept``'s output) before the run.

Figures (``figures.npz``):

* ``graph.raw`` — ``gen_A_concept(…, t=0.3, gen_mode='Complex')['adj_all']`` of the stored counts, and
  ``graph.adj`` — its ``gen_adj`` (the matrix the GCN multiplies with);
* ``fwd.*`` — one training-mode ``forward_emb`` on batch 0 (batch norm on batch statistics): region and word
  vectors, both instance attentions (the text one over every padded position, as CVSE computes it), the GCN's
  concept vectors, the concept distributions ``w_v``/``w_t``, the consensus-level, instance and fused
  embeddings;
* ``loss.*`` — CVSE's four loss terms (unweighted) and ``forward_loss``'s total on it; ``grad.<name>`` — the
  gradient of that total for every parameter it reaches (before clipping);
* ``step.loss`` — the totals of three ``train_emb`` steps (Adam, ``grad_clip`` 2, batches 0, 1, 2) from the
  initial state, and ``step.<name>`` — every stored parameter and batch-norm statistic after them;
* ``eval.*`` — after those steps, an evaluation-mode ``forward_emb`` (running statistics) on the evaluation
  batch, with each caption's own concept labels (CVSE's test-time labels), and ``eval.scores`` = the cosine of
  the fused vectors.

Parameter names are CVSE's (``<module>.<state-dict key>``); the test maps them to retr's.
"""
from __future__ import annotations

import os

os.environ["CUDA_VISIBLE_DEVICES"] = ""          # CVSE moves everything to CUDA when it sees a GPU: stay on the CPU

import argparse  # noqa: E402
import pickle  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Patch, patched_copy, write_figures  # noqa: E402

REPOSITORY = "https://github.com/BruceW91/CVSE"

PATCHES = [
    Patch("model_CVSE.py", "import torchtext\n", "",
          "torchtext is not installed (and no longer released for torch 2.x); CVSE uses it only to load GloVe or "
          "fastText in EncoderText.init_weights, and the golden run uses wemb_type='random_init' (the stored "
          "initial state replaces the embedding anyway)"),
    Patch("util/util_C_GCN.py", "_adj_OPC = _adj_OPC + np.identity(num_classes, np.int)",
          "_adj_OPC = _adj_OPC + np.identity(num_classes, int)",
          "np.int was removed in NumPy 1.24 (AttributeError); it was an alias of int"),
    Patch("util/util_C_GCN.py", "_adj_OMC = _adj_OMC + np.identity(num_classes, np.int)",
          "_adj_OMC = _adj_OMC + np.identity(num_classes, int)",
          "np.int was removed in NumPy 1.24 (AttributeError); it was an alias of int"),
    Patch("util/util_C_GCN.py", "_adj_all = _adj_all + np.identity(num_classes, np.int)",
          "_adj_all = _adj_all + np.identity(num_classes, int)",
          "np.int was removed in NumPy 1.24 (AttributeError); it was an alias of int"),
    Patch("util/util_C_GCN.py", "D = torch.pow(A.sum(1).float(), -0.5)", "D = torch.pow(A.sum(1), -0.5)",
          "gen_adj casts the degree vector to float32; with the float64 graph of this run, matmul(float64 A, "
          "float32 D) raises in torch 2.x. In CVSE's own float32 runs the cast is a no-op, so removing it "
          "changes nothing there and keeps the figures in float64"),
]

SEED = 20210101
EMBED, IMG_DIM, REGIONS, WORD_DIM, VOCAB = 16, 8, 36, 6, 20
CONCEPTS, CONCEPT_DIM = 12, 10
BATCH, STEPS = 6, 3
LENGTHS = [[9, 8, 6, 5, 3, 2], [7, 7, 6, 4, 4, 3], [8, 5, 5, 4, 3, 2], [9, 6, 5, 4, 3, 2]]   # sorted: CVSE packs
LR, GRAD_CLIP, MARGIN, LABEL_RATIO = 0.01, 2.0, 0.2, 0.35
#: token ids 4..15 are the 12 concepts' words (0 <pad>, 1 <start>, 2 <end>, 3 <unk> as in CVSE's vocabularies)
TOKEN_CONCEPTS = np.array([-1] * 4 + list(range(CONCEPTS)) + [-1] * (VOCAB - 4 - CONCEPTS), dtype=np.int64)

#: the modules of CVSE's model whose parameters and batch-norm statistics the forward pass uses, and the keys
#: of each that are not used there (CVSE builds them but never calls them) or are aliases of another key
MODULES = ("img_enc", "txt_enc", "V_self_atten_enhance", "T_self_atten_enhance", "V_consensus_level_embedding",
           "T_consensus_level_embedding", "C_GCN")
UNUSED = ("V_self_atten_enhance.fc2_2.", "V_self_atten_enhance.fc4.", "V_self_atten_enhance.embedding_2_2.",
          "C_GCN.joint_att_emb.", "C_GCN.adj_")


def _stored_key(name: str) -> bool:
    """Keep ``name`` (``<module>.<key>``) in the stored state: used by the forward pass, not an alias."""
    if name.startswith(UNUSED) or name.endswith("num_batches_tracked"):
        return False
    # ``embedding_k.0`` is the Linear ``fck`` again (nn.Sequential holds the same module)
    return ".embedding_1.0." not in name and ".embedding_2.0." not in name and ".embedding_3.0." not in name


def make_inputs(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Counts, concept vectors, batches and the initial state (filled in by :func:`initial_state`)."""
    nums = rng.integers(50, 400, CONCEPTS).astype(np.int32)
    pairs = np.zeros((CONCEPTS, CONCEPTS), dtype=np.int32)
    for i in range(CONCEPTS):
        for j in range(i + 1, CONCEPTS):
            pairs[i, j] = pairs[j, i] = int(rng.uniform(0.0, 0.45) * min(nums[i], nums[j]))
    inputs = {"graph.nums": nums, "graph.pairs": pairs,
              "concept_vectors": rng.normal(0.0, 0.4, (CONCEPTS, CONCEPT_DIM))}
    batches = len(LENGTHS)
    lengths = np.array(LENGTHS, dtype=np.int64)
    tokens = np.zeros((batches, BATCH, max(map(max, LENGTHS))), dtype=np.int64)
    for s in range(batches):
        for b, n in enumerate(lengths[s]):
            tokens[s, b, :n] = np.concatenate([[1], rng.integers(3, VOCAB, n - 2), [2]])
    labels = (rng.random((batches, BATCH, CONCEPTS)) < 0.3).astype(np.float64)
    labels[0, 3] = 0.0                            # an image without concepts (CVSE: uniform 1/C; same softmax)
    own = np.zeros((BATCH, CONCEPTS))
    for b, n in enumerate(lengths[-1]):
        concept = TOKEN_CONCEPTS[tokens[-1, b, :n]]
        own[b, concept[concept >= 0]] = 1.0
    inputs.update({
        "train.features": rng.uniform(0.0, 1.0, (STEPS, BATCH, REGIONS, IMG_DIM)),
        "train.tokens": tokens[:STEPS], "train.lengths": lengths[:STEPS], "train.labels": labels[:STEPS],
        "eval.features": rng.uniform(0.0, 1.0, (BATCH, REGIONS, IMG_DIM)),
        "eval.tokens": tokens[-1], "eval.lengths": lengths[-1], "eval.labels": own,
        "token_concepts": TOKEN_CONCEPTS,
        "setting.lr": np.float64(LR), "setting.grad_clip": np.float64(GRAD_CLIP),
        "setting.margin": np.float64(MARGIN), "setting.label_ratio": np.float64(LABEL_RATIO),
        "setting.fuse_weight": np.float64(0.85), "setting.smooth": np.float64(10.0),
        "setting.graph_threshold": np.float64(0.3),
    })
    return inputs


def initial_state(model, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A random value for every stored key of ``model`` (Linear/GRU/GCN weights at their usual scales, batch-norm
    affine and running statistics away from 1/0 so that each is exercised)."""
    state = {}
    for module in MODULES:
        for key, value in getattr(model, module).state_dict().items():
            name = f"{module}.{key}"
            if not _stored_key(name):
                continue
            shape = tuple(value.shape)
            if "running_var" in key:
                x = rng.uniform(0.5, 1.5, shape)
            elif "running_mean" in key:
                x = rng.normal(0.0, 0.1, shape)
            elif key.endswith(".weight") and len(shape) == 1:                     # batch-norm scale
                x = 1.0 + rng.normal(0.0, 0.1, shape)
            elif key.endswith("bias") or "bias_" in key:
                x = rng.normal(0.0, 0.05, shape)
            elif key == "embed.weight":
                x = rng.uniform(-0.5, 0.5, shape)
            else:                                                                   # Linear, GRU, GCN weights
                fan = shape[1] if module != "C_GCN" else shape[0]
                x = rng.uniform(-1.0, 1.0, shape) / np.sqrt(fan)
            state[name] = x
    return state


def build_model(code: Path, adj_file: Path):
    import torch

    sys.path.insert(0, str(code))
    from model_CVSE import CVSE

    opt = SimpleNamespace(
        grad_clip=GRAD_CLIP, data_name="f30k_precomp", Concept_label_ratio=LABEL_RATIO, img_dim=IMG_DIM,
        embed_size=EMBED, precomp_enc_type="basic", no_imgnorm=False, wemb_type="random_init", vocab_size=VOCAB,
        word_dim=WORD_DIM, num_layers=1, bi_gru=True, no_txtnorm=False, use_abs=False, dropout_rate=0.0,
        use_BatchNorm=True, activation_type="tanh", num_attribute=CONCEPTS, input_channel=CONCEPT_DIM,
        adj_file=str(adj_file), norm_func_type="sigmoid", feature_fuse_type="weight_sum", margin=MARGIN,
        measure="cosine", max_violation=True, learning_rate=LR, learning_rate_MLGCN=LR)
    torch.manual_seed(SEED)
    model = CVSE({}, opt)
    for module in MODULES:
        getattr(model, module).double()      # converts each parameter's data in place: CVSE's optimiser keeps them
    assert model.optimizer.param_groups[0]["params"][0] is model.img_enc.fc.weight
    assert model.img_enc.fc.weight.dtype == torch.float64
    model.logger = SimpleNamespace(update=lambda *args, **kwargs: None)
    return model


def load_state(model, state: dict[str, np.ndarray]) -> None:
    import torch

    for module in MODULES:
        part = {k[len(module) + 1:]: torch.from_numpy(v) for k, v in state.items() if k.startswith(module + ".")}
        target = getattr(model, module)
        if module == "img_enc":                   # CVSE overrides load_state_dict (no strict argument)
            target.load_state_dict(part)
            continue
        missing, unexpected = target.load_state_dict(part, strict=False)
        assert not unexpected, unexpected
        assert all(not _stored_key(f"{module}.{k}") for k in missing), missing


def snapshot(model, prefix: str) -> dict[str, np.ndarray]:
    return {f"{prefix}{module}.{k}": v.detach().numpy().copy() for module in MODULES
            for k, v in getattr(model, module).state_dict().items() if _stored_key(f"{module}.{k}")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help=f"a checkout of {REPOSITORY}")
    args = parser.parse_args(argv)
    code = patched_copy(args.checkout.resolve(), PATCHES)
    try:
        run(args, code)
    finally:
        shutil.rmtree(code.parent, ignore_errors=True)


def run(args, code: Path) -> None:
    import torch

    torch.set_default_dtype(torch.float64)
    torch.use_deterministic_algorithms(True)
    # one thread: the figures are then the same bits wherever they are made (at 2 threads CVSE's own run differs
    # by up to 4e-8 after the steps, on the biases whose exact gradient is 0; see the test's tolerances)
    torch.set_num_threads(1)
    rng = np.random.default_rng(SEED)
    inputs = make_inputs(rng)
    adj_file = code / "golden_adj_concepts.pkl"
    pairs = inputs["graph.pairs"]
    # CVSE's adjacency file: symmetric co-occurrence counts with a zero diagonal and the per-concept counts
    # (the layout of its released f30k_adj_concepts.pkl); O_P/O_M are built and never used by 'whole_graph'
    with open(adj_file, "wb") as f:
        pickle.dump({"nums": inputs["graph.nums"], "adj_all": pairs, "adj_O_P": pairs // 2,
                     "adj_O_M": pairs - pairs // 2}, f)

    model = build_model(code, adj_file)
    state = initial_state(model, rng)
    inputs.update({f"init.{k}": v for k, v in state.items()})

    from util.util_C_GCN import gen_A_concept, gen_adj

    raw = gen_A_concept(CONCEPTS, 0.3, str(adj_file), gen_mode="Complex")["adj_all"]
    figures = {"graph.raw": raw, "graph.adj": gen_adj(torch.from_numpy(raw)).numpy()}
    # the model's graph parameter is float32 in CVSE (``.float()`` in C_GCN.__init__); give it the float64 one
    with torch.no_grad():
        model.C_GCN.adj_all.copy_(torch.from_numpy(raw))

    def batch(s: int | str):
        src = "eval" if s == "eval" else "train"
        index = () if s == "eval" else (s,)
        features = torch.from_numpy(inputs[f"{src}.features"][index])
        tokens = torch.from_numpy(inputs[f"{src}.tokens"][index])
        lengths = [int(n) for n in inputs[f"{src}.lengths"][index]]
        tokens = tokens[:, :max(lengths)]
        labels = torch.from_numpy(inputs[f"{src}.labels"][index])
        vectors = torch.from_numpy(inputs["concept_vectors"]).unsqueeze(0).expand(BATCH, -1, -1)   # collate_fn
        return features, tokens, labels, vectors, lengths

    captured: dict[str, object] = {}

    def keep(name):
        return lambda module, args, output: captured.__setitem__(name, output)

    hooks = [model.img_enc.register_forward_hook(keep("img_enc")),
             model.txt_enc.register_forward_hook(keep("txt_enc")),
             model.V_self_atten_enhance.register_forward_hook(keep("v_att")),
             model.T_self_atten_enhance.register_forward_hook(keep("t_att")),
             model.C_GCN.register_forward_hook(keep("gcn"))]

    def emb_figures(prefix: str, emb_v, emb_t, w_v, w_t) -> dict[str, np.ndarray]:
        out = {"regions": captured["img_enc"][0], "words": captured["txt_enc"][0],
               "region_attention": captured["v_att"][1], "word_attention": captured["t_att"][1],
               "concepts": captured["gcn"], "w_v": w_v, "w_t": w_t,
               "instance_v": emb_v[0], "instance_t": emb_t[0], "consensus_v": emb_v[1], "consensus_t": emb_t[1],
               "fused_v": emb_v[2], "fused_t": emb_t[2]}
        return {f"{prefix}{k}": v.detach().numpy().copy() for k, v in out.items()}

    # 1. one training-mode forward, the loss terms and the gradient
    load_state(model, state)
    model.train_start()
    emb_v, emb_t, w_v, w_t = model.forward_emb(*batch(0), model.fuse_weight)
    figures.update(emb_figures("fwd.", emb_v, emb_t, w_v, w_t))
    terms = {"rank_fused": model.criterion_rank(emb_v[2], emb_t[2]),
             "rank_instance": model.criterion_rank(emb_v[0], emb_t[0]),
             "rank_consensus": model.criterion_rank(emb_v[1], emb_t[1]),
             "kl": model.criterion_KL_softmax(w_v, w_t)}
    figures.update({f"loss.{k}": v.detach().numpy() for k, v in terms.items()})
    model.optimizer.zero_grad()
    total = model.forward_loss(emb_v, emb_t, w_v, w_t, model.dataset_name)
    total.backward()
    figures["loss.total"] = total.detach().numpy()
    for module in MODULES:
        for key, p in getattr(model, module).named_parameters():
            if p.grad is not None and _stored_key(f"{module}.{key}"):
                figures[f"grad.{module}.{key}"] = p.grad.numpy().copy()

    # 2. three training steps from the initial state (a fresh model: fresh Adam moments and statistics)
    for h in hooks:
        h.remove()
    model = build_model(code, adj_file)
    with torch.no_grad():
        model.C_GCN.adj_all.copy_(torch.from_numpy(raw))
    load_state(model, state)
    model.train_start()
    losses = []
    forward_loss = model.forward_loss
    model.forward_loss = lambda *a, **k: losses.append(forward_loss(*a, **k)) or losses[-1]
    for s in range(STEPS):
        features, tokens, labels, vectors, lengths = batch(s)
        model.train_emb(features, tokens, labels, vectors, lengths)
    figures["step.loss"] = np.array([float(x.detach()) for x in losses])
    figures.update(snapshot(model, "step."))

    # 3. evaluation mode after the steps, each caption with its own concept labels
    hooks = [model.img_enc.register_forward_hook(keep("img_enc")),
             model.txt_enc.register_forward_hook(keep("txt_enc")),
             model.V_self_atten_enhance.register_forward_hook(keep("v_att")),
             model.T_self_atten_enhance.register_forward_hook(keep("t_att")),
             model.C_GCN.register_forward_hook(keep("gcn"))]
    model.val_start()
    with torch.no_grad():
        emb_v, emb_t, w_v, w_t = model.forward_emb(*batch("eval"), model.fuse_weight, volatile=True)
    figures.update(emb_figures("eval.", emb_v, emb_t, w_v, w_t))
    figures["eval.scores"] = (emb_v[2] @ emb_t[2].t()).numpy()

    notes = ("CVSE's CVSE object on the CPU in float64, Flickr30K configuration at tiny sizes, dropout_rate 0, "
             f"seed {SEED}; the GCN's graph parameter gets the float64 gen_A_concept output (CVSE stores it as "
             "float32). See tools/golden/cvse.py's docstring for every figure.")
    folder = write_figures("cvse", repository=REPOSITORY, source=args.checkout.resolve(), patches=PATCHES,
                           inputs=inputs, figures=figures, notes=notes)
    size = sum(p.stat().st_size for p in folder.iterdir())
    print(f"wrote {folder} ({size / 1024:.0f} KiB): {len(inputs)} inputs, {len(figures)} figures; "
          f"step losses {figures['step.loss']}")


if __name__ == "__main__":
    main()
