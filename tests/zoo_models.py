"""The model zoo's language models: tiny Hugging Face decoders (dense and MoE),
encoders and encoder-decoders, `torch.nn.Transformer` and two ordinary wrappers; their
batches and loss. tests/zoo_media.py holds the vision, speech and image-text models,
tests/zoo.py the list of them all.

Every model is built from a tiny config (random weights, nothing downloaded) with 2
layers, so that each can cut into 2 pipeline stages, and with dropout and LayerDrop
off, so that a training step is deterministic.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.models import Seq2Seq, key_biases_off_zero, tiny_llama

VOCAB = 128
SEQ = 16
BATCH = 8

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


# -- decoders ---------------------------------------------------------------------------


def _decoder_sizes() -> dict[str, Any]:
    """The sizes every tiny decoder shares (Llama's config names, which most follow)."""
    return {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "use_cache": False,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,  # a padding row in the embedding, as released checkpoints have
    }


def llama() -> nn.Module:
    return tiny_llama(pad_token_id=0)  # a padding row, as released checkpoints have


def mistral() -> nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**_decoder_sizes(), sliding_window=8))


def qwen2() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**_decoder_sizes()))


def qwen3() -> nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # Qwen3 normalizes each head's queries and keys (q_norm, k_norm).
    return Qwen3ForCausalLM(Qwen3Config(**_decoder_sizes(), head_dim=16))


def phi3() -> nn.Module:
    from transformers import Phi3Config, Phi3ForCausalLM

    # Phi-3 fuses q/k/v and gate/up into one weight each.
    config = Phi3Config(**_decoder_sizes(), resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)
    return Phi3ForCausalLM(config)


def gemma() -> nn.Module:
    from transformers import GemmaConfig, GemmaForCausalLM

    # Gemma's default head_dim is 256, far wider than this model's hidden size.
    return GemmaForCausalLM(GemmaConfig(**_decoder_sizes(), head_dim=16))


def gpt_neox() -> nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    # One fused query_key_value weight, heads interleaved; attention and MLP in parallel.
    config = GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cache=False,
    )
    return key_biases_off_zero(GPTNeoXForCausalLM(config))


def opt() -> nn.Module:
    from transformers import OPTConfig, OPTForCausalLM

    # Learned absolute positions, offset by 2 as OPT's checkpoints have them.
    config = OPTConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        ffn_dim=128,
        num_attention_heads=4,
        max_position_embeddings=64,
        word_embed_proj_dim=64,
        dropout=0.0,
        attention_dropout=0.0,
        layerdrop=0.0,
        use_cache=False,
    )
    return key_biases_off_zero(OPTForCausalLM(config))


def falcon() -> nn.Module:
    from transformers import FalconConfig, FalconForCausalLM

    # Falcon-7B's layout: multi-query attention (one key/value head) beside the MLP.
    config = FalconConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cache=False,
    )
    return FalconForCausalLM(config)


def mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**_decoder_sizes(), num_local_experts=4, num_experts_per_tok=2)
    return MixtralForCausalLM(config)


def qwen2_moe() -> nn.Module:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    # Routed experts plus a gated shared expert in every layer.
    config = Qwen2MoeConfig(
        **_decoder_sizes(),
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
    )
    return Qwen2MoeForCausalLM(config)


def olmoe() -> nn.Module:
    from transformers import OlmoeConfig, OlmoeForCausalLM

    config = OlmoeConfig(**_decoder_sizes(), num_experts=4, num_experts_per_tok=2)
    return OlmoeForCausalLM(config)


# -- encoders and encoder-decoders ------------------------------------------------------


def encoder_sizes() -> dict[str, Any]:
    """BERT's config names, which its descendants keep."""
    return {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "max_position_embeddings": 64,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    }


def bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    return key_biases_off_zero(BertForMaskedLM(BertConfig(**encoder_sizes())))


def distilbert() -> nn.Module:
    from transformers import DistilBertConfig, DistilBertForMaskedLM

    config = DistilBertConfig(
        vocab_size=VOCAB,
        dim=64,
        n_layers=2,
        n_heads=4,
        hidden_dim=128,
        max_position_embeddings=64,
        dropout=0.0,
        attention_dropout=0.0,
    )
    return key_biases_off_zero(DistilBertForMaskedLM(config))


def deberta_v2() -> nn.Module:
    from transformers import DebertaV2Config, DebertaV2ForMaskedLM

    # Disentangled attention: content-to-position and position-to-content terms.
    config = DebertaV2Config(
        **encoder_sizes(), relative_attention=True, pos_att_type=["p2c", "c2p"]
    )
    return key_biases_off_zero(DebertaV2ForMaskedLM(config))


def bart() -> nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=VOCAB,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=64,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        encoder_layerdrop=0.0,
        decoder_layerdrop=0.0,
        use_cache=False,
    )
    return Seq2Seq(key_biases_off_zero(BartForConditionalGeneration(config)))


class TorchTransformer(nn.Module):
    """`torch.nn.Transformer` (fused in_proj attention) between a token embedding with
    learned positions and a vocabulary head, causal in the decoder."""

    def __init__(self, width: int = 64, max_len: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.positions = nn.Parameter(torch.randn(max_len, width) * 0.02)
        self.transformer = nn.Transformer(
            d_model=width,
            nhead=4,
            num_encoder_layers=2,
            num_decoder_layers=2,
            dim_feedforward=2 * width,
            dropout=0.0,
            batch_first=True,
        )
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor, decoder_ids: torch.Tensor) -> torch.Tensor:
        src = self.embed(ids) + self.positions[: ids.shape[1]]
        tgt = self.embed(decoder_ids) + self.positions[: decoder_ids.shape[1]]
        mask = nn.Transformer.generate_square_subsequent_mask(decoder_ids.shape[1])
        return self.head(self.transformer(src, tgt, tgt_mask=mask, tgt_is_causal=True))


def torch_transformer() -> nn.Module:
    return key_biases_off_zero(TorchTransformer())


# -- wrappers ---------------------------------------------------------------------------


class Varargs(nn.Module):
    """A `forward(self, *args)` adapter, a common way to fit a model to a training loop."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: torch.Tensor):
        return self.model(*args)


def llama_varargs() -> nn.Module:
    return Varargs(llama())


class DictOutput(nn.Module):
    """A model returning a dict of outputs rather than a tensor or a ModelOutput."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.model(ids, output_hidden_states=True)
        return {"logits": out.logits, "hidden": out.hidden_states[-1]}


def llama_dict_output() -> nn.Module:
    return DictOutput(llama())


# -- inputs and losses ------------------------------------------------------------------


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def tokens(*shape: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=seeded(seed))


def token_batch() -> Batch:
    return (tokens(BATCH, SEQ, seed=1),), tokens(BATCH, SEQ, seed=2)


def seq2seq_batch() -> Batch:
    # A decoder half as long as the encoder: the two sequences need not agree.
    ids, decoder_ids = tokens(BATCH, SEQ, seed=1), tokens(BATCH, SEQ // 2, seed=2)
    return (ids, decoder_ids), tokens(BATCH, SEQ // 2, seed=3)


def token_loss(output, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every position's logits (an LM's, a masked LM's, a decoder's,
    a CTC head's per audio frame)."""
    logits = output["logits"] if isinstance(output, dict) else getattr(output, "logits", output)
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())
