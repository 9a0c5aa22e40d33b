"""SMFEA's context-aware structured tree encoder (VCS-Tree / TCS-Tree): a 7-node tree-LSTM (its Eq. 5–14).

The tree is the shared referral tree's shape, slots in in-order ``[E1 R2 E3 R4 E5 R6 E7]`` (index 0–6)::

                 R4 (3)
            /            \\
        R2 (1)          R6 (5)
        /    \\          /    \\
     E1 (0)  E3 (2)   E5 (4)  E7 (6)

Each node ``t`` has its own input ``x_t = W^o_t · v`` (Eq. 5: seven linear maps of the instance feature ``v``
[B, d] to ``input_dim``). Leaves have no children (``h̃ = 0``, no memory term); R2 and R6 read two leaves, R4
reads R2 and R6. Node update (Eq. 6–11), with ``h̃_t = Σ_{k∈T(t)} h_k``::

    i_t = σ(W^i x_t + U^i h̃_t)      f_t = σ(W^f x_t + U^f h̃_t)      o_t = σ(W^o x_t + U^o h̃_t)
    u_t = tanh(W^u x_t + U^u h̃_t)
    c_t = i_t ⊙ u_t + f_t ⊙ Σ_k (f_k ⊙ c_k)        (``forget_gate="as-printed"``)
    c_t = i_t ⊙ u_t + Σ_k σ(W^f x_t + U^f h_k) ⊙ c_k  (``forget_gate="per-child"``: Tai et al.'s child-sum)
    h_t = o_t ⊙ tanh(c_t)

The choices the paper leaves open (gate names, the forget gate, the node input size, which parameters are
shared) and their options: ``docs/models-smfea.md``, decisions 2–5.

Outputs: hidden states ``[B, 7, hidden]`` in slot order. Classifiers (Eq. 12–13) and the tree embedding
(Eq. 14) live in :class:`StructuredTreeEncoder`.
"""
from __future__ import annotations

import torch
from torch import nn

from retr.trainers.models.layers import l2norm

#: slot index → its children's slot indices (in-order layout E1 R2 E3 R4 E5 R6 E7)
CHILDREN: dict[int, tuple[int, ...]] = {0: (), 2: (), 4: (), 6: (), 1: (0, 2), 5: (4, 6), 3: (1, 5)}
#: bottom-up update order: the four leaves, the two relations of layer 2, the root
UPDATE_ORDER = (0, 2, 4, 6, 1, 5, 3)
ENTITY_SLOTS = (0, 2, 4, 6)
RELATION_SLOTS = (1, 3, 5)
NUM_NODES = 7
FORGET_GATES = ("as-printed", "per-child")


class SevenNodeTreeLSTM(nn.Module):
    """Child-sum tree-LSTM over the fixed 7-node tree: inputs ``[B, 7, input_dim]`` → ``(h, c)`` each
    ``[B, 7, hidden_size]``, slot order."""

    def __init__(self, input_dim: int, hidden_size: int = 128, forget_gate: str = "as-printed"):
        super().__init__()
        if forget_gate not in FORGET_GATES:
            raise ValueError(f"forget_gate must be one of {', '.join(FORGET_GATES)}, not {forget_gate!r}")
        self.hidden_size = hidden_size
        self.forget_gate = forget_gate
        self.W = nn.Linear(input_dim, 4 * hidden_size)              # W^i, W^f, W^o, W^u (with the bias)
        self.U = nn.Linear(hidden_size, 4 * hidden_size, bias=False)  # U^i, U^f, U^o, U^u

    def forward(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``inputs`` [B, 7, input_dim] (slot order) → hidden ``[B, 7, H]`` and memory ``[B, 7, H]``."""
        if inputs.dim() != 3 or inputs.shape[1] != NUM_NODES:
            raise ValueError(f"inputs must be [B, 7, D], got {tuple(inputs.shape)}")
        hsz = self.hidden_size
        wx = self.W(inputs)                                           # [B, 7, 4H]
        h: dict[int, torch.Tensor] = {}
        c: dict[int, torch.Tensor] = {}
        f: dict[int, torch.Tensor] = {}
        for t in UPDATE_ORDER:
            kids = CHILDREN[t]
            wx_i, wx_f, wx_o, wx_u = wx[:, t].split(hsz, dim=-1)
            if kids:
                h_sum = h[kids[0]] + h[kids[1]]
                uh_i, uh_f, uh_o, uh_u = self.U(h_sum).split(hsz, dim=-1)
            else:
                uh_i = uh_f = uh_o = uh_u = 0.0
            i_t = torch.sigmoid(wx_i + uh_i)
            f_t = torch.sigmoid(wx_f + uh_f)
            o_t = torch.sigmoid(wx_o + uh_o)
            u_t = torch.tanh(wx_u + uh_u)
            c_t = i_t * u_t
            if kids:
                if self.forget_gate == "as-printed":
                    c_t = c_t + f_t * sum(f[k] * c[k] for k in kids)
                else:
                    u_f = self.U.weight[hsz:2 * hsz]                    # U^f rows
                    c_t = c_t + sum(torch.sigmoid(wx_f + h[k] @ u_f.t()) * c[k] for k in kids)
            h[t], c[t], f[t] = o_t * torch.tanh(c_t), c_t, f_t
        order = range(NUM_NODES)
        return torch.stack([h[t] for t in order], dim=1), torch.stack([c[t] for t in order], dim=1)


class StructuredTreeEncoder(nn.Module):
    """One modality's tree (VCS-Tree or TCS-Tree): instance feature ``[B, d]`` → node logits and tree embedding.

    * Eq. 5: seven ``Linear(d → input_dim)`` maps, one per node;
    * :class:`SevenNodeTreeLSTM` (Eq. 6–11);
    * Eq. 12–13: leaves classified by ``W_e`` into the entity dictionary, inner nodes by ``W_r`` into the
      relation dictionary (logits; softmax is taken by the losses);
    * Eq. 14: ``tree = Σ_t W_t h_t`` with a separate ``Linear(hidden → d)`` per node, then l2-normalised so it
      is on the scale of the instance and concept vectors it is fused with (the paper does not say; option
      ``normalize``). ``residual=True`` adds the instance feature before normalising (the paper's sentence on
      S_T "the sum of the hidden states … and the original instance-level feature S_D"). This module's own
      default is off (Eq. 14 as it writes V_T); SMFEA passes its ``tree_residual`` setting, which is **on** by
      default, for both trees alike (``docs/models-smfea.md``, C6; runs written before that default keep it off).
    """

    def __init__(self, embed_size: int, num_entities: int, num_relations: int, hidden_size: int = 128,
                 input_dim: int | None = None, forget_gate: str = "as-printed", normalize: bool = True,
                 residual: bool = False):
        super().__init__()
        input_dim = input_dim or hidden_size
        self.normalize, self.residual = normalize, residual
        self.node_inputs = nn.ModuleList(nn.Linear(embed_size, input_dim) for _ in range(NUM_NODES))
        self.lstm = SevenNodeTreeLSTM(input_dim, hidden_size, forget_gate)
        self.entity_classifier = nn.Linear(hidden_size, num_entities)
        self.relation_classifier = nn.Linear(hidden_size, num_relations)
        self.node_outputs = nn.ModuleList(nn.Linear(hidden_size, embed_size) for _ in range(NUM_NODES))

    def forward(self, instance: torch.Tensor) -> dict[str, torch.Tensor]:
        """``instance`` [B, d] → ``entity_logits`` [B, 4, n_entities] (slots E1 E3 E5 E7),
        ``relation_logits`` [B, 3, n_relations] (slots R2 R4 R6), ``hidden`` [B, 7, H], ``tree`` [B, d]."""
        inputs = torch.stack([m(instance) for m in self.node_inputs], dim=1)     # [B, 7, input_dim]
        hidden, _ = self.lstm(inputs)
        tree = sum(m(hidden[:, t]) for t, m in enumerate(self.node_outputs))
        if self.residual:
            tree = tree + instance
        if self.normalize:
            tree = l2norm(tree, dim=-1)
        return {"entity_logits": self.entity_classifier(hidden[:, list(ENTITY_SLOTS)]),
                "relation_logits": self.relation_classifier(hidden[:, list(RELATION_SLOTS)]),
                "hidden": hidden, "tree": tree}
