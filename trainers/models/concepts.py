"""The consensus-aware concept (CAC) branch of CVSE, which SMFEA reuses (§3.2.3; reference/models.md).

:class:`ConceptGCN` vectors ``[C, 300]`` → ``[C, d]``; :class:`ConceptAttention` ``[B, d]`` → ``w`` ``[B, C]``;
:func:`mix_text_labels`, :func:`consensus_vector` ``[B, d]``. Equations and settings: docs/models-smfea.md."""
from __future__ import annotations

import torch
from torch import nn

from retr.trainers.models.layers import l2norm

CONCEPT_VECTOR_MODES = ("learned", "fixed")


class ConceptGCN(nn.Module):
    """Two graph convolutions over the concept graph: ``[C, word_dim]`` vectors → ``[C, d]`` (l2-normalised)."""

    def __init__(self, num_concepts: int, word_dim: int = 300, hidden_dim: int = 512, embed_size: int = 1024,
                 concept_vectors: str = "learned"):
        super().__init__()
        if concept_vectors not in CONCEPT_VECTOR_MODES:
            raise ValueError(f"concept_vectors must be one of {', '.join(CONCEPT_VECTOR_MODES)}")
        self.concept_vectors = concept_vectors
        self.register_buffer("adjacency", torch.eye(num_concepts))          # set from concepts.h5
        vectors = torch.empty(num_concepts, word_dim).uniform_(-0.1, 0.1)
        if concept_vectors == "learned":
            self.vectors = nn.Parameter(vectors)
        else:
            self.register_buffer("vectors", vectors)
        self.weight1 = nn.Parameter(torch.empty(word_dim, hidden_dim))
        self.weight2 = nn.Parameter(torch.empty(hidden_dim, embed_size))
        for w in (self.weight1, self.weight2):           # ML-GCN's GraphConvolution init: U(±1/√out)
            bound = 1.0 / w.shape[1] ** 0.5
            nn.init.uniform_(w, -bound, bound)
        self.act = nn.LeakyReLU(0.2)

    @torch.no_grad()
    def set_graph(self, adjacency: torch.Tensor, vectors: torch.Tensor | None = None) -> None:
        """Install the normalised graph ``[C, C]`` and, optionally, the initial concept vectors ``[C, word_dim]``."""
        if adjacency.shape != self.adjacency.shape:
            raise ValueError(f"adjacency must be {tuple(self.adjacency.shape)}, got {tuple(adjacency.shape)}")
        self.adjacency.copy_(adjacency)
        if vectors is not None:
            if vectors.shape != self.vectors.shape:
                raise ValueError(f"concept vectors must be {tuple(self.vectors.shape)}, got {tuple(vectors.shape)}")
            self.vectors.copy_(vectors)

    def forward(self) -> torch.Tensor:
        """The concept representations ``[C, d]``."""
        x = self.adjacency @ (self.vectors @ self.weight1)
        x = self.adjacency @ (self.act(x) @ self.weight2)
        return l2norm(x, dim=-1)


class ConceptAttention(nn.Module):
    """``w`` [B, C]: attention of each instance feature over the concepts (softmax over C, temperature λ)."""

    def __init__(self, embed_size: int = 1024, smooth: float = 10.0):
        super().__init__()
        self.smooth = smooth
        self.fc_concept = nn.Linear(embed_size, embed_size)
        self.bn_concept = nn.BatchNorm1d(embed_size)
        self.fc_instance = nn.Linear(embed_size, embed_size)
        self.bn_instance = nn.BatchNorm1d(embed_size)
        self.fc_score = nn.Linear(embed_size, 1)

    def forward(self, concepts: torch.Tensor, instance: torch.Tensor) -> torch.Tensor:
        """``concepts`` [C, d], ``instance`` [B, d] → ``[B, C]`` (rows sum to 1)."""
        c = torch.tanh(self.bn_concept(self.fc_concept(concepts)))              # [C, d]
        x = torch.tanh(self.bn_instance(self.fc_instance(instance)))            # [B, d]
        logits = self.fc_score(c.unsqueeze(0) * x.unsqueeze(1)).squeeze(-1)     # [B, C]
        return torch.softmax(self.smooth * logits, dim=-1)


def mix_text_labels(weights: torch.Tensor, labels: torch.Tensor, ratio: float, smooth: float = 10.0) -> torch.Tensor:
    """``ratio·softmax(smooth·labels) + (1−ratio)·weights``; ``weights``/``labels`` [B, C] → [B, C]."""
    return ratio * torch.softmax(smooth * labels.to(weights.dtype), dim=-1) + (1.0 - ratio) * weights


def consensus_vector(weights: torch.Tensor, concepts: torch.Tensor) -> torch.Tensor:
    """``l2norm(weights @ concepts)``: [B, C] × [C, d] → [B, d]."""
    return l2norm(weights @ concepts, dim=-1)
