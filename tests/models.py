"""Tiny models built from configs (random weights, nothing downloaded) and their losses."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 128
SEQ = 16


def tiny_gpt2(seed: int = 0, layers: int = 2, dropout: float = 0.0) -> nn.Module:
    """A tiny GPT-2; `dropout` on its embeddings, attention and residuals."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        n_embd=64,
        n_layer=layers,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    return GPT2LMHeadModel(config)


def tiny_llama(
    seed: int = 0, layers: int = 2, pad_token_id: int | None = None, positions: int = 64
) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        pad_token_id=pad_token_id,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=positions,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return LlamaForCausalLM(config)


class Seq2Seq(nn.Module):
    """An encoder-decoder taking (encoder ids, decoder ids) positionally, as train_step
    passes them (T5's own second positional argument is the attention mask)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, decoder_ids: torch.Tensor):
        return self.model(input_ids=ids, decoder_input_ids=decoder_ids)


def tiny_t5(seed: int = 0) -> nn.Module:
    """T5 with its learned relative-position attention bias."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=VOCAB,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        use_cache=False,
        decoder_start_token_id=0,
    )
    return Seq2Seq(T5ForConditionalGeneration(config))


class MLP(nn.Module):
    def __init__(self, width: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.head = nn.Linear(16 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        return self.head(x.flatten(1))


class FixedLengthLM(nn.Module):
    """A small language model, hand-written as many are: a learned absolute position
    table read up to the sequence's length taken as a Python int. It trains at any
    length up to `max_len`, but torch.export keeps the length static at the example's
    (the int specializes it). Returns the logits."""

    def __init__(self, width: int = 32, layers: int = 2, max_len: int = 64, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, width)
        self.positions = nn.Parameter(torch.randn(max_len, width) * 0.02)
        self.layers = nn.ModuleList(_Block(width) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = int(ids.shape[1])
        x = self.embed(ids) + self.positions[:length]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def lm_loss(output, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits (`output.logits`, or `output` itself) per token."""
    logits = getattr(output, "logits", output)
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def lm_and_router_loss(output, target: torch.Tensor) -> torch.Tensor:
    """The language-model loss plus the load-balancing loss a mixture of experts returns
    (`tiny_mixtral(router_loss=True)`), weighed up so that a wrong one would show."""
    return lm_loss(output, target) + 0.5 * output.aux_loss


class RouterLoss(nn.Module):
    """A load-balancing loss written as Hugging Face's Mixtral writes it: the tokens each
    expert is chosen for (histc) and their router probabilities (sum), each divided by
    the token count, multiplied."""

    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(8, experts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.router(tokens), dim=-1)
        chosen = torch.topk(probs, 2, dim=-1).indices.reshape(-1).float()
        experts = probs.shape[-1]
        counts = torch.histc(chosen, bins=experts, min=0, max=experts) / tokens.shape[0]
        return probs, (counts * (probs.sum(dim=0) / tokens.shape[0])).sum() * experts


def tiny_mixtral(seed: int = 0, router_loss: bool = False, intermediate: int = 128) -> nn.Module:
    """A sparse mixture-of-experts decoder: 4 routed experts, 2 per token, in each of 2
    layers, each `intermediate` wide; with `router_loss`, it also returns the
    load-balancing loss (`aux_loss`)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        use_cache=False,
        output_router_logits=router_loss,
    )
    return MixtralForCausalLM(config)


def token_batch(batch: int = 8, seq: int = SEQ, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    return ids, torch.randint(0, VOCAB, (batch, seq), generator=g)


# The key biases of BERT, BART/CLIP/ViT/wav2vec2, DistilBERT, DeBERTa's position keys and
# GPT-NeoX (fused with q and v; it rotates only a quarter of each head, rotary_pct).
_KEY_BIASES = ("key.bias", "k_proj.bias", "k_lin.bias", "query_key_value.bias", "pos_key_proj.bias")


def key_biases_off_zero(model: nn.Module) -> nn.Module:
    """Start the attention key biases from small random values instead of zeros. With
    absolute positions (no rotary embedding) softmax ignores a constant added to every
    key, so a key bias's true gradient is exactly zero and its fp32 gradient is rounding
    noise that Adam turns into updates of random sign: a zero-initialized key bias ends
    at ~1e-8, all noise, and no two summation orders agree on it. Started off zero, its
    comparison is about the distributed arithmetic again."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(_KEY_BIASES):
                param.normal_(0.0, 0.02)
    return model


def make_optimizer(kind: str):
    if kind == "sgd":
        return lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if kind == "adafactor":  # not elementwise: row and column statistics of each matrix
        return lambda params: torch.optim.Adafactor(params, lr=1e-2)
    # eps=1e-6, not 1e-8: GPT-2's key bias has an exactly zero true gradient (softmax
    # ignores a constant added to every key), so its fp32 gradient is rounding noise of
    # ~1e-10 that any change of summation order alters, and Adam with eps=1e-8 turns that
    # noise into full-size updates of random sign. The larger eps keeps the comparison
    # about the distributed arithmetic rather than about amplified noise.
    return lambda params: torch.optim.AdamW(params, lr=1e-3, eps=1e-6, weight_decay=0.01)


def llama_training_case():
    """A whole training case, as `autopart verify --model` takes one: (model, inputs,
    target, loss_fn, optimizer), each picklable."""
    ids, target = token_batch(8)
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3, eps=1e-6)  # see make_optimizer
    return tiny_llama(), (ids,), target, lm_loss, optimizer


def llama3_8b_on_meta(positions: int = 8192) -> nn.Module:
    """Llama-3-8B's shape (hidden 4096, 32 layers, 32 heads, 8 KV heads, FFN 14336,
    vocabulary 128256) on the meta device: nothing is allocated."""
    return _llama_on_meta(
        intermediate_size=14336,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=positions,
    )


def llama2_7b_on_meta(positions: int = 4096) -> nn.Module:
    """Llama-2-7B's shape (hidden 4096, 32 layers, 32 heads, FFN 11008, vocabulary
    32000) on the meta device."""
    return _llama_on_meta(
        intermediate_size=11008,
        num_key_value_heads=32,
        vocab_size=32000,
        max_position_embeddings=positions,
    )


def _llama_on_meta(**config: int) -> nn.Module:
    """A Llama of hidden size 4096, 32 layers and 32 heads, with `config`, on meta."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = LlamaConfig(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, use_cache=False, **config
    )
    with torch.device("meta"):
        return LlamaForCausalLM(shape)


def mixtral_8x7b_on_meta(positions: int = 4096) -> nn.Module:
    """Mixtral-8x7B's shape (hidden 4096, 32 layers, 32 heads, 8 KV heads, 8 experts of
    FFN 14336, 2 per token, vocabulary 32000) on the meta device."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=32000,
        max_position_embeddings=positions,
        use_cache=False,
    )
    with torch.device("meta"):
        return MixtralForCausalLM(config)


def eager_attention(factory: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """`factory`'s model with attention written out (scores, mask, softmax, weighted
    values) instead of the fused kernel: its saved score matrices grow with the sequence
    squared, what selective recomputation frees."""

    def build(seed: int = 0, layers: int = 2) -> nn.Module:
        model = factory(seed=seed, layers=layers)
        model.config._attn_implementation = "eager"
        return model

    return build


LM_FACTORIES = {
    "gpt2": tiny_gpt2,
    "llama": tiny_llama,
    "gpt2-eager": eager_attention(tiny_gpt2),
    "llama-eager": eager_attention(tiny_llama),
}


def train_single_device(
    model_name: str, optimizer: str, steps: int, batch, layers: int = 2, seed: int = 0
) -> dict:
    """The reference: the unmodified model on one device, on the whole global batch."""
    model = LM_FACTORIES[model_name](seed=seed, layers=layers)
    ids, target = batch
    return train_reference(model, optimizer, steps, (ids,), target)


def train_reference(
    model: nn.Module, optimizer: str, steps: int, inputs: tuple, target, loss_fn=None
) -> dict:
    """`model` trained on one device: `loss_fn(model(*inputs), target)` (the language
    model's loss by default), `steps` times; its losses and parameters."""
    loss_fn = loss_fn or lm_loss
    opt = make_optimizer(optimizer)(model.parameters())
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model(*inputs), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": snapshot(model)}


def train_replicas_apart(
    factory,
    optimizer: str,
    steps: int,
    inputs: tuple,
    target,
    replicas: int,
    every: int,
    warmup: int,
    outer: dict | None = None,
    loss_fn=None,
) -> dict:
    """Local SGD as separate models give it: `replicas` copies of `factory()`, each on
    its contiguous share of the batch, their gradients averaged for `warmup` steps, then
    their own, their parameters averaged after every `every`-th local step; with an
    `outer` SGD (its arguments), the parameters held since the last averaging step by
    their difference from the mean, and the replicas go on from them. The losses are
    the replicas' mean; the parameters, the first replica's."""
    loss_fn = loss_fn or lm_loss
    shares = list(zip(*(t.chunk(replicas) for t in (*inputs, target))))
    models = [factory() for _ in range(replicas)]
    optimizers = [make_optimizer(optimizer)(m.parameters()) for m in models]
    anchor: list[torch.Tensor] = []
    losses = []
    for step in range(1, steps + 1):
        if outer is not None and step == warmup + 1:
            anchor = [p.detach().clone() for p in models[0].parameters()]
            outer_sgd = torch.optim.SGD(anchor, **outer)
        local = []
        for model, opt, (*xs, ts) in zip(models, optimizers, shares):
            opt.zero_grad()
            loss = loss_fn(model(*xs), ts)
            loss.backward()
            local.append(loss.item())
        if step <= warmup:
            for params in zip(*(m.parameters() for m in models)):
                mean = torch.stack([p.grad for p in params]).mean(0)
                for p in params:
                    p.grad = mean.clone()
        for opt in optimizers:
            opt.step()
        if step > warmup and (step - warmup) % every == 0:
            with torch.no_grad():
                for params in zip(*(m.parameters() for m in models)):
                    mean = torch.stack(list(params)).mean(0)
                    for p in params:
                        p.copy_(mean)
                if outer is not None:
                    for a, p in zip(anchor, models[0].parameters()):
                        a.grad = a - p
                    outer_sgd.step()
                    for model in models:
                        for a, p in zip(anchor, model.parameters()):
                            p.copy_(a)
        losses.append(sum(local) / replicas)
    return {"losses": losses, "params": snapshot(models[0])}


def train_autocast_reference(name: str, precision: str, steps: int, batch) -> list[float]:
    """The losses of `name`'s model trained on one CPU under autocast in `precision`
    ("bf16-mixed" or "fp16-mixed"), with SGD and momentum, on the whole batch."""
    ids, target = batch
    model = LM_FACTORIES[name]()
    opt = make_optimizer("sgd")(model.parameters())
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss = lm_loss(model(ids), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def train_host_masters_reference(build: Callable[[], nn.Module], batches: list) -> dict:
    """`build()`'s model trained on one CPU, a step on each of `batches`, under bf16
    autocast with SGD and momentum over fp32 master weights, its weights read as their
    bf16 copies and its gradients rounded to bf16 (autopart's `master_weights="host"`):
    the parameters hold the copies' values in fp32, which autocast's contractions read
    exactly as the bf16 copies and every other operator reads widened, as autopart's
    graph does."""
    model = build()
    names, params = zip(*model.named_parameters())  # tied weights once
    masters = [nn.Parameter(p.detach().clone()) for p in params]
    opt = make_optimizer("sgd")(masters)
    losses = []
    for ids, target in batches:
        with torch.no_grad():
            for p, master in zip(params, masters):
                p.copy_(master.to(torch.bfloat16))
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(model(ids), target)
        loss.backward()
        for p, master in zip(params, masters):
            master.grad = p.grad.to(torch.bfloat16).float()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: m.detach().clone() for n, m in zip(names, masters)}}


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters (tied ones once, under their first name)."""
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def assert_matches(result: dict, reference: dict, rtol: float = 1e-5) -> None:
    """Losses within `rtol` (relative) at every step; parameters within `rtol` relative
    as one vector (norm of the difference over norm of the reference), and each tensor
    within 10 × `rtol`. The per-tensor bound is looser because a zero-initialized bias
    trained by Adam sits at the scale of its rounding noise (float64 runs of the same
    plans agree to 1e-14); a real layout bug moves a tensor by O(1)."""
    for step, (got, want) in enumerate(zip(result["losses"], reference["losses"], strict=True)):
        assert abs(got - want) <= rtol * abs(want), f"step {step}: loss {got} != {want}"
    assert result["params"].keys() == reference["params"].keys()
    total_err, total_norm = 0.0, 0.0
    for name, want in reference["params"].items():
        got = result["params"][name]
        assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        err = (got - want).norm().item()
        norm = want.norm().item()
        total_err, total_norm = total_err + err**2, total_norm + norm**2
        assert err <= 10 * rtol * max(norm, 1e-12), f"{name}: relative error {err / norm:.2e}"
    assert total_err**0.5 <= rtol * total_norm**0.5, "parameters differ beyond rtol overall"
