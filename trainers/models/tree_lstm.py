"""SMFEA's structured tree encoder (VCS-Tree / TCS-Tree): a 7-node tree-LSTM (Eq. 5–14).

Slots ``[E1 R2 E3 R4 E5 R6 E7]`` (0–6), R4 the root; outputs: hidden states ``[B, 7, hidden]`` in slot order.
Equations and choices: docs/models-smfea.md ("The model as implemented", decisions 2–5, C6)."""
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
    """One modality's tree: instance feature ``[B, d]`` → node logits and tree embedding ``[B, d]``.

    Eq. 5 input maps, :class:`SevenNodeTreeLSTM`, Eq. 12–13 classifiers (logits: leaves over entities, inner nodes
    over relations), Eq. 14 embedding; ``residual`` adds the instance feature (off here; SMFEA passes its own)."""

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
