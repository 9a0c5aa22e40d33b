"""SMFEA's structured tree encoder (VCS-Tree / TCS-Tree): a 7-node tree-LSTM (Eq. 5–14).

Slots ``[E1 R2 E3 R4 E5 R6 E7]`` (0–6), R4 the root; outputs: hidden states ``[B, 7, hidden]`` in slot order.
Equations and choices: docs/models-smfea.md ("The model as implemented", decisions 2–5, C6)."""
from __future__ import annotations

import torch
from torch import nn

from retr.trainers.models.layers import l2norm

#: slot index → its children's slot indices (in-order layout E1 R2 E3 R4 E5 R6 E7)
CHILDREN: dict[int, tuple[int, ...]] = {0: (), 2: (), 4: (), 6: (), 1: (0, 2), 5: (4, 6), 3: (1, 5)}
#: the tree's levels, bottom-up, each a slice of the slots: the four leaves E1 E3 E5 E7 (0::2), the relations
#: R2 R6 (1::4), the root R4 (3::4). A level's children are the level below in consecutive pairs: R2 ← E1, E3;
#: R6 ← E5, E7; R4 ← R2, R6.
LEVELS = (slice(0, None, 2), slice(1, None, 4), slice(3, None, 4))
#: bottom-up update order (the levels' slots in turn)
UPDATE_ORDER = (0, 2, 4, 6, 1, 5, 3)
ENTITY_SLOTS = (0, 2, 4, 6)
RELATION_SLOTS = (1, 3, 5)
NUM_NODES = 7
FORGET_GATES = ("as-printed", "per-child")


class SevenNodeTreeLSTM(nn.Module):
    """Child-sum tree-LSTM over the fixed 7-node tree: inputs ``[B, 7, input_dim]`` → ``(h, c)`` each
    ``[B, 7, hidden_size]``, slot order.

    The nodes of a level are updated together (:data:`LEVELS`: the 4 leaves, then the 2 inner relations, then the
    root): each node's gates are Eq. 6–11 on its own inputs and its children's states, so the values are those of
    a node-by-node update, in 3 rounds of batched operators instead of 7."""

    def __init__(self, input_dim: int, hidden_size: int = 128, forget_gate: str = "as-printed"):
        super().__init__()
        if forget_gate not in FORGET_GATES:
            raise ValueError(f"forget_gate must be one of {', '.join(FORGET_GATES)}, not {forget_gate!r}")
        self.hidden_size = hidden_size
        self.forget_gate = forget_gate
        self.W = nn.Linear(input_dim, 4 * hidden_size)              # W^i, W^f, W^o, W^u (with the bias)
        self.U = nn.Linear(hidden_size, 4 * hidden_size, bias=False)  # U^i, U^f, U^o, U^u
        # where each slot lies among the levels' slots laid end to end (0 2 4 6 | 1 5 | 3)
        self.register_buffer("slot_positions", torch.tensor(UPDATE_ORDER).argsort(), persistent=False)

    def forward(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``inputs`` [B, 7, input_dim] (slot order) → hidden ``[B, 7, H]`` and memory ``[B, 7, H]``."""
        if inputs.dim() != 3 or inputs.shape[1] != NUM_NODES:
            raise ValueError(f"inputs must be [B, 7, D], got {tuple(inputs.shape)}")
        wx = self.W(inputs)                                           # [B, 7, 4H]
        states, below = [], None
        for level in LEVELS:
            below = self._level(wx[:, level], below)
            states.append(below)
        h, c = (torch.cat([state[k] for state in states], 1).index_select(1, self.slot_positions) for k in (0, 1))
        return h, c

    def _level(self, wx: torch.Tensor, children: tuple[torch.Tensor, ...] | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One level's ``(h, c, f)`` ``[B, n, H]`` from its ``W x + b`` ``[B, n, 4H]`` and the level below's
        ``(h, c, f)`` ``[B, 2n, H]`` (node j's children at 2j and 2j+1; None for the leaves)."""
        hsz = self.hidden_size
        z = wx
        if children is not None:
            h_kids, c_kids, f_kids = children
            z = wx + self.U(h_kids[:, 0::2] + h_kids[:, 1::2])           # Σ_k h_k through U
        gates = torch.sigmoid(z[..., :3 * hsz])
        i_t, f_t, o_t = gates.split(hsz, dim=-1)
        c_t = i_t * torch.tanh(z[..., 3 * hsz:])
        if children is not None:
            if self.forget_gate == "as-printed":                        # f_t · Σ_k f_k ⊙ c_k (Eq. 9 as printed)
                kept = f_kids * c_kids
            else:                                                         # Σ_k σ(W^f x_t + b^f + U^f h_k) ⊙ c_k
                u_f = self.U.weight[hsz:2 * hsz]                          # U^f rows
                kept = torch.sigmoid(wx[..., hsz:2 * hsz].repeat_interleave(2, dim=1) + h_kids @ u_f.t()) * c_kids
            kept = kept[:, 0::2] + kept[:, 1::2]
            c_t = c_t + (f_t * kept if self.forget_gate == "as-printed" else kept)
        return o_t * torch.tanh(c_t), c_t, f_t


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
        # the 7 node maps as one product each: [B, d] → [B, 7, input_dim], and [B, 7, H] → Σ_t W_t h_t + b_t
        weights = torch.stack([m.weight for m in self.node_inputs])                       # [7, input_dim, d]
        biases = torch.stack([m.bias for m in self.node_inputs])                          # [7, input_dim]
        inputs = torch.einsum("bd,nkd->bnk", instance, weights) + biases
        hidden, _ = self.lstm(inputs)
        out_weights = torch.stack([m.weight for m in self.node_outputs], 1)               # [d, 7, H]
        tree = hidden.flatten(1) @ out_weights.flatten(1).t() + torch.stack([m.bias for m in self.node_outputs]).sum(0)
        if self.residual:
            tree = tree + instance
        if self.normalize:
            tree = l2norm(tree, dim=-1)
        return {"entity_logits": self.entity_classifier(hidden[:, 0::2]),          # ENTITY_SLOTS
                "relation_logits": self.relation_classifier(hidden[:, 1::2]),      # RELATION_SLOTS
                "hidden": hidden, "tree": tree}
