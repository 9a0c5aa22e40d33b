"""Caption encoders shared by the models: word embedding + GRU, with the authors' ``EncoderText`` parameter names;
a pretrained BERT + a linear map (VSE∞'s ``master`` branch ``EncoderText``: ``bert``, ``linear``)."""
from __future__ import annotations

import torch
from torch import nn

from retr.trainers.models.layers import EPS, l2norm, lengths_mask, run_rnn
from retr.trainers.models.pretrained_bert import bert_network


class GRUWordEncoder(nn.Module):
    """Per-word vectors ``[B, L, d]`` of captions ``[B, L]`` (SCAN's ``EncoderText``; docs/trainer.md)."""

    def __init__(self, vocab_size: int, word_dim: int = 300, embed_size: int = 1024, num_layers: int = 1,
                 bidirectional: bool = True, normalize: bool = True, dropout: float = 0.0):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.embed_size = embed_size
        self.bidirectional = bidirectional
        self.normalize = normalize
        self.embed = nn.Embedding(vocab_size, word_dim)
        self.rnn = nn.GRU(word_dim, embed_size, num_layers, batch_first=True, bidirectional=bidirectional)
        nn.init.uniform_(self.embed.weight, -0.1, 0.1)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``tokens`` [B, L] long, ``lengths`` [B] (≥ 1) → ``[B, max(lengths), d]``."""
        x = self.dropout(self.embed(tokens))
        out = run_rnn(self.rnn, x, lengths)
        if self.bidirectional:
            out = (out[:, :, :self.embed_size] + out[:, :, self.embed_size:]) / 2
        return l2norm(out, dim=-1) if self.normalize else out


class GRUSentenceEncoder(GRUWordEncoder):
    """One vector ``[B, d]`` per caption: the GRU state at the last word (VSE++'s ``EncoderText``).

    Unidirectional by default as in VSE++; bidirectional averages the forward state at the last word with the
    backward state at the first word (both have read the whole caption)."""

    def __init__(self, vocab_size: int, word_dim: int = 300, embed_size: int = 1024, num_layers: int = 1,
                 bidirectional: bool = False, normalize: bool = True, eps: float = EPS):
        super().__init__(vocab_size, word_dim, embed_size, num_layers, bidirectional, normalize=False)
        self.normalize_sentence, self.eps = normalize, eps   # eps of the l2norm (VSE++'s code: 0)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        out = run_rnn(self.rnn, x, lengths)
        last = (lengths.to(out.device, non_blocking=True) - 1).view(-1, 1, 1).expand(-1, 1, out.shape[-1])
        sentence = out.gather(1, last).squeeze(1)
        if self.bidirectional:
            sentence = (sentence[:, :self.embed_size] + out[:, 0, self.embed_size:]) / 2
        return l2norm(sentence, dim=-1, eps=self.eps) if self.normalize_sentence else sentence


class BertWordEncoder(nn.Module):
    """Per-token vectors ``[B, L, d]`` of WordPiece captions ``[B, L]``: BERT's last hidden states (transformers'
    ``BertModel`` of ``bert_config``, its stored configuration), then ``linear`` (Linear(hidden → d)).

    A token attends to the real tokens of its caption: positions before its length whose id is not BERT's
    ``[PAD]`` (the authors' mask is ``tokens != 0``; within a caption only a training replacement can draw
    ``[PAD]``). The mask goes to BERT as a boolean ``[B, 1, 1, L]`` key mask made on the tokens' device, so
    nothing is read back from it."""

    def __init__(self, bert_config: dict, embed_size: int = 1024):
        super().__init__()
        self.bert = bert_network(bert_config)
        self.pad_id = int(bert_config["pad_token_id"])
        self.linear = nn.Linear(int(bert_config["hidden_size"]), embed_size)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``tokens`` [B, L] long, ``lengths`` [B] (on the host or the tokens' device) → ``[B, L, d]``."""
        attend = lengths_mask(lengths, tokens.shape[1], tokens.device) & (tokens != self.pad_id)
        hidden = self.bert(input_ids=tokens, attention_mask=attend[:, None, None, :])[0]
        return self.linear(hidden)


@torch.no_grad()
def install_word_vectors(embed: nn.Embedding, inputs: dict, freeze: bool = False) -> None:
    """Copy ``inputs["word_vectors"]`` [V, D] into ``embed``'s first V rows where ``inputs["word_vectors_found"]``
    [V] (other rows, and rows past V such as VSE∞'s ``<mask>``, keep their init); ``freeze`` stops training the
    embedding. No ``word_vectors``: nothing changes."""
    vectors = inputs.get("word_vectors")
    if vectors is None:
        return
    rows, dim = embed.weight.shape
    if vectors.shape[1] != dim or vectors.shape[0] > rows:
        raise ValueError(f"word vectors are {tuple(vectors.shape)}, the embedding {(rows, dim)}")
    found = inputs["word_vectors_found"].to(embed.weight.device)
    embed.weight[:len(found)][found] = vectors.to(embed.weight)[found]
    embed.weight.requires_grad_(not freeze)
