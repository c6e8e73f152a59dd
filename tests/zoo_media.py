"""The model zoo's vision, speech and image-text models: tiny Hugging Face ViT, Swin,
ConvNeXt, ResNet, MobileNetV2, EfficientNet, Whisper, wav2vec 2.0 and CLIP, a BatchNorm
CNN and a CLIP-style two-tower model; their batches and losses.

Built as tests/zoo_models.py builds its models: tiny configs, 2 layers or stages, no
dropout, LayerDrop or SpecAugment.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.models import key_biases_off_zero
from tests.zoo_models import BATCH, SEQ, VOCAB, Batch, encoder_sizes, seeded, tokens

IMAGE = 32  # pixels a side, 3 channels
CLASSES = 10


# -- vision -----------------------------------------------------------------------------


def vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        **{k: v for k, v in encoder_sizes().items() if k != "vocab_size"},
        image_size=IMAGE,
        patch_size=8,
        num_channels=3,
        num_labels=CLASSES,
    )
    return key_biases_off_zero(ViTForImageClassification(config))


def swin() -> nn.Module:
    from transformers import SwinConfig, SwinForImageClassification

    # Shifted 4×4 windows over 8×8 patches, then a patch merging to 4×4.
    config = SwinConfig(
        image_size=IMAGE,
        patch_size=4,
        embed_dim=32,
        depths=[2, 2],
        num_heads=[2, 4],
        window_size=4,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0,
        num_labels=CLASSES,
    )
    return key_biases_off_zero(SwinForImageClassification(config))


def convnext() -> nn.Module:
    from transformers import ConvNextConfig, ConvNextForImageClassification

    config = ConvNextConfig(
        image_size=IMAGE,
        hidden_sizes=[32, 64],
        depths=[2, 2],
        num_stages=2,
        drop_path_rate=0.0,
        num_labels=CLASSES,
    )
    return ConvNextForImageClassification(config)


def resnet() -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    # ResNet-18's basic blocks, two stages of one block each.
    config = ResNetConfig(
        embedding_size=16,
        hidden_sizes=[16, 32],
        depths=[1, 1],
        layer_type="basic",
        num_labels=CLASSES,
    )
    return ResNetForImageClassification(config)


def mobilenet_v2() -> nn.Module:
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

    # Inverted residuals with depthwise convolutions and BatchNorm, a quarter as wide.
    config = MobileNetV2Config(
        image_size=IMAGE,
        depth_multiplier=0.25,
        min_depth=8,
        classifier_dropout_prob=0.0,
        num_labels=CLASSES,
    )
    return MobileNetV2ForImageClassification(config)


def efficientnet() -> nn.Module:
    from transformers import EfficientNetConfig, EfficientNetForImageClassification

    # EfficientNet-B0's stages, a quarter as wide and one block each; its top is 1280
    # channels scaled alike (round_filters), which `hidden_dim` must name.
    config = EfficientNetConfig(
        image_size=IMAGE,
        width_coefficient=0.25,
        depth_coefficient=0.25,
        hidden_dim=320,
        dropout_rate=0.0,
        drop_connect_rate=0.0,
        num_labels=CLASSES,
    )
    return EfficientNetForImageClassification(config)


class ConvBNNet(nn.Module):
    """A plain CNN as in any tutorial: conv, BatchNorm and ReLU blocks, pooled, then a
    linear classifier. BatchNorm normalizes by statistics of the batch it sees."""

    def __init__(self, widths: tuple[int, ...] = (3, 16, 32, 32)) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            *(
                nn.Sequential(
                    nn.Conv2d(w_in, w_out, 3, stride=2, padding=1),
                    nn.BatchNorm2d(w_out),
                    nn.ReLU(),
                )
                for w_in, w_out in zip(widths, widths[1:], strict=False)
            )
        )
        self.head = nn.Linear(widths[-1], CLASSES)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(pixels).mean(dim=(2, 3)))


# -- speech and image-text --------------------------------------------------------------

MEL_BINS = 16
MEL_FRAMES = 32  # Whisper's encoder takes exactly 2 × max_source_positions frames
AUDIO_SAMPLES = 160
AUDIO_FRAMES = 15  # what wav2vec2's two convolutions below leave of 160 samples
CTC_VOCAB = 32


class SpeechSeq2Seq(nn.Module):
    """Whisper taking (log-mel features, decoder ids) positionally, as train_step passes
    them."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, features: torch.Tensor, decoder_ids: torch.Tensor):
        return self.model(input_features=features, decoder_input_ids=decoder_ids)


def whisper() -> nn.Module:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=MEL_BINS,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        d_model=64,
        max_source_positions=MEL_FRAMES // 2,
        max_target_positions=32,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        encoder_layerdrop=0.0,
        decoder_layerdrop=0.0,
        use_cache=False,
        decoder_start_token_id=0,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return SpeechSeq2Seq(WhisperForConditionalGeneration(config))


def wav2vec2() -> nn.Module:
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    # Raw audio through a convolutional feature encoder (GroupNorm), a weight-normed
    # convolutional position embedding, then the transformer and a CTC head.
    config = Wav2Vec2Config(
        vocab_size=CTC_VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        conv_dim=(32, 32),
        conv_kernel=(10, 3),
        conv_stride=(5, 2),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        hidden_dropout=0.0,
        activation_dropout=0.0,
        attention_dropout=0.0,
        feat_proj_dropout=0.0,
        final_dropout=0.0,
        layerdrop=0.0,
        mask_time_prob=0.0,
        mask_feature_prob=0.0,
    )
    return key_biases_off_zero(Wav2Vec2ForCTC(config))


class ImageText(nn.Module):
    """CLIP as it trains: images and captions embedded apart, every image scored against
    every caption of the batch (`logits_per_image`, a batch × batch matrix)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, pixel_values=pixels).logits_per_image


def clip() -> nn.Module:
    from transformers import CLIPConfig, CLIPModel

    tower = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "attention_dropout": 0.0,
    }
    config = CLIPConfig(
        # CLIP pools each caption at its first end token: one inside this vocabulary.
        text_config={
            **tower,
            "vocab_size": VOCAB,
            "max_position_embeddings": 64,
            "bos_token_id": 0,
            "eos_token_id": 1,
        },
        vision_config={**tower, "image_size": IMAGE, "patch_size": 8},
        projection_dim=32,
    )
    return ImageText(key_biases_off_zero(CLIPModel(config)))


class TwoTower(nn.Module):
    """A CLIP-style two-tower model as people write it: a small convolutional image
    tower and a bag-of-words caption tower, each projected and normalized, every image
    scored against every caption at a learned temperature."""

    def __init__(self, width: int = 16, dim: int = 8) -> None:
        super().__init__()
        self.image = nn.Sequential(
            nn.Conv2d(3, width, 3, stride=2, padding=1),
            nn.GELU(),
            nn.Conv2d(width, width, 3, stride=2, padding=1),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(width, dim),
        )
        self.words = nn.Embedding(VOCAB, width)
        self.text = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, dim))
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, ids: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
        images = F.normalize(self.image(pixels), dim=-1)
        captions = F.normalize(self.text(self.words(ids).mean(dim=1)), dim=-1)
        return self.logit_scale.exp() * images @ captions.T


# -- inputs and losses ------------------------------------------------------------------


def image_batch() -> Batch:
    pixels = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=seeded(1))
    return (pixels,), tokens(BATCH, seed=2, vocab=CLASSES)


def speech_seq2seq_batch() -> Batch:
    features = torch.randn(BATCH, MEL_BINS, MEL_FRAMES, generator=seeded(1))
    return (features, tokens(BATCH, SEQ // 2, seed=2)), tokens(BATCH, SEQ // 2, seed=3)


def audio_batch() -> Batch:
    """Raw waveforms, each audio frame labelled with one of the CTC head's tokens."""
    audio = torch.randn(BATCH, AUDIO_SAMPLES, generator=seeded(1))
    return (audio,), tokens(BATCH, AUDIO_FRAMES, seed=2, vocab=CTC_VOCAB)


def image_text_batch() -> Batch:
    """Captions and images; the target is each image's own caption, its batch index."""
    pixels = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=seeded(2))
    return (tokens(BATCH, SEQ, seed=1), pixels), torch.arange(BATCH)


def class_loss(output, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(getattr(output, "logits", output), target)


def contrastive_loss(logits_per_image: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """CLIP's symmetric loss: each image picks its caption among the batch's and each
    caption its image."""
    return (
        F.cross_entropy(logits_per_image, target) + F.cross_entropy(logits_per_image.T, target)
    ) / 2


def image_loss(logits_per_image: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The image side of CLIP's loss alone: each image picks its caption, a mean over
    the score matrix's rows."""
    return F.cross_entropy(logits_per_image, target)
