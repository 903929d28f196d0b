"""HF transformers models of the suite: encoders, decoders (GQA, MQA, sliding-window
attention), encoder-decoders, vision and speech transformers, each from its config with
random weights, at the size its users run and at a tiny size for CPU CI."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from .spec import Inputs, ModelSpec, hf_loss, images, no_randomness, token_ids
from .tv_shim import ensure_torchvision

# Config attributes that switch on randomness in training mode: all set to zero.
_RANDOM_ATTRS = ("layerdrop", "mask_time_prob", "mask_feature_prob", "drop_path_rate")
# Tiny sizes shared by the text models (CPU CI): two layers, narrow, short sequences.
_TINY_TEXT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=64, vocab_size=128, max_position_embeddings=64)


def _deterministic(config: Any) -> Any:
    for attr, value in list(vars(config).items()):
        if isinstance(value, float) and ("dropout" in attr or "pdrop" in attr
                                         or attr in _RANDOM_ATTRS):
            setattr(config, attr, 0.0)
    if hasattr(config, "use_cache"):
        config.use_cache = False
    return config


def _builder(model_cls: str, config_cls: str, full: dict[str, Any],
             tiny: dict[str, Any]) -> Callable[[bool], nn.Module]:
    def build(is_tiny: bool) -> nn.Module:
        ensure_torchvision()  # transformers imports torchvision where it is installed
        import transformers

        config = getattr(transformers, config_cls)(**(tiny if is_tiny else full))
        model = getattr(transformers, model_cls)(_deterministic(config))
        return no_randomness(model)
    return build


def _mlm(vocab: int, full: tuple[int, int], tiny: tuple[int, int], tiny_vocab: int,
         is_tiny: bool, batch: int | None) -> Inputs:
    b, s = tiny if is_tiny else full
    b, v = batch or b, tiny_vocab if is_tiny else vocab
    ids = token_ids(b, s, v)
    masked = torch.rand(b, s) < 0.15
    masked[:, 0] = True  # never an all-ignored row
    return {"input_ids": ids, "attention_mask": torch.ones(b, s, dtype=torch.long),
            "labels": torch.where(masked, token_ids(b, s, v), -100)}


def _causal(vocab: int, full: tuple[int, int], tiny: tuple[int, int], tiny_vocab: int,
            is_tiny: bool, batch: int | None) -> Inputs:
    b, s = tiny if is_tiny else full
    ids = token_ids(batch or b, s, tiny_vocab if is_tiny else vocab)
    return {"input_ids": ids, "labels": ids.clone()}


def _token_classes(vocab: int, full: tuple[int, int], tiny: tuple[int, int],
                   tiny_vocab: int, is_tiny: bool, batch: int | None) -> Inputs:
    b, s = tiny if is_tiny else full
    b = batch or b
    return {"input_ids": token_ids(b, s, tiny_vocab if is_tiny else vocab),
            "labels": torch.randint(0, 2, (b, s))}


def _seq2seq(vocab: int, full: tuple[int, int, int], tiny: tuple[int, int, int],
             tiny_vocab: int, is_tiny: bool, batch: int | None) -> Inputs:
    b, s, t = tiny if is_tiny else full
    b, v = batch or b, tiny_vocab if is_tiny else vocab
    return {"input_ids": token_ids(b, s, v), "decoder_input_ids": token_ids(b, t, v),
            "labels": token_ids(b, t, v)}


def _image_cls(full: tuple[int, int, int], tiny: tuple[int, int, int], is_tiny: bool,
               batch: int | None) -> Inputs:
    b, size, classes = tiny if is_tiny else full
    b = batch or b
    return {"pixel_values": images(b, size), "labels": torch.randint(0, classes, (b,))}


def _clip(is_tiny: bool, batch: int | None) -> Inputs:
    b, s, size, v = (2, 8, 32, 128) if is_tiny else (32, 77, 224, 49408)
    b = batch or b
    return {"input_ids": token_ids(b, s, v), "pixel_values": images(b, size)}


def _segformer(is_tiny: bool, batch: int | None) -> Inputs:
    b, size, classes = (2, 32, 4) if is_tiny else (8, 512, 150)
    b = batch or b
    return {"pixel_values": images(b, size),
            "labels": torch.randint(0, classes, (b, size, size))}


def _whisper(is_tiny: bool, batch: int | None) -> Inputs:
    b, mels, frames, t, v = (2, 8, 32, 8, 128) if is_tiny else (8, 80, 3000, 128, 51865)
    b = batch or b
    return {"input_features": torch.randn(b, mels, frames),
            "decoder_input_ids": token_ids(b, t, v), "labels": token_ids(b, t, v)}


def _ctc(is_tiny: bool, batch: int | None) -> Inputs:
    b, samples, label_len, v = (2, 1600, 4, 16) if is_tiny else (8, 160000, 80, 32)
    b = batch or b
    return {"input_values": torch.randn(b, samples),
            "labels": torch.randint(1, v, (b, label_len))}


def _text(name: str, model_cls: str, config_cls: str, full: dict[str, Any],
          inputs: Callable[..., Inputs], vocab: int, shape: tuple[int, ...],
          tiny: dict[str, Any] | None = None, tiny_shape: tuple[int, ...] = (2, 16),
          dtype: torch.dtype = torch.float16, train: bool = False,
          optimizer: str | None = None) -> ModelSpec:
    tiny_cfg = {**_TINY_TEXT, **(tiny or {})}
    return ModelSpec(name, "hf", _builder(model_cls, config_cls, full, tiny_cfg),
                     partial(inputs, vocab, shape, tiny_shape, tiny_cfg["vocab_size"]),
                     dtype, hf_loss, ("labels",), train, optimizer, labels_to_model=True)


_LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                 max_position_embeddings=4096, rope_theta=500000.0, tie_word_embeddings=True)
_QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                  max_position_embeddings=4096, tie_word_embeddings=True)
# Mistral-7B's layer (GQA 32/8, sliding window) with eight of its 32 layers, so that one
# card holds it in every backend at once; the window is shorter than the sequence.
_MISTRAL_8L = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=8,
                   num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                   max_position_embeddings=4096, sliding_window=1024)
_GEMMA_2B = dict(hidden_size=2048, intermediate_size=16384, num_hidden_layers=18,
                 num_attention_heads=8, num_key_value_heads=1, head_dim=256,
                 vocab_size=256000, max_position_embeddings=4096)
_PHI_15 = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
               num_attention_heads=32, vocab_size=51200, partial_rotary_factor=0.5,
               max_position_embeddings=2048)
_PYTHIA_410M = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                    num_attention_heads=16, vocab_size=50304, rotary_pct=0.25,
                    max_position_embeddings=2048)
_GQA_TINY = dict(num_attention_heads=4, num_key_value_heads=2)
_GPT2_TINY = dict(n_embd=32, n_layer=2, n_head=2, vocab_size=128, n_positions=64)
_OPT_TINY = dict(ffn_dim=64, word_embed_proj_dim=32)
_T5_BASE = dict(vocab_size=32128, d_model=768, d_kv=64, d_ff=3072, num_layers=12,
                num_heads=12)
_T5_TINY = dict(vocab_size=128, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2)
_BART_BASE = dict(vocab_size=50265, d_model=768, encoder_layers=6, decoder_layers=6,
                  encoder_attention_heads=12, decoder_attention_heads=12,
                  encoder_ffn_dim=3072, decoder_ffn_dim=3072)
_BART_TINY = dict(vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2,
                  encoder_attention_heads=2, decoder_attention_heads=2,
                  encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)
_VIT_TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=64, image_size=32, patch_size=8, num_labels=10)
_SWIN_TINY = dict(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                  num_heads=[2, 4], window_size=4, num_labels=10)


def _vision(name: str, model_cls: str, config_cls: str, full: dict[str, Any],
            tiny: dict[str, Any], shape: tuple[int, int], train: bool = False,
            optimizer: str | None = None) -> ModelSpec:
    full_shape = (*shape, full.get("num_labels", 1000))
    tiny_shape = (2, tiny["image_size"], tiny["num_labels"])
    return ModelSpec(name, "hf", _builder(model_cls, config_cls, full, tiny),
                     partial(_image_cls, full_shape, tiny_shape),
                     torch.float16, hf_loss, ("labels",), train, optimizer,
                     labels_to_model=True)


def _model(name: str, model_cls: str, config_cls: str, full: dict[str, Any],
           tiny: dict[str, Any], inputs: Callable[[bool, int | None], Inputs],
           dtype: torch.dtype = torch.float16, train: bool = False) -> ModelSpec:
    return ModelSpec(name, "hf", _builder(model_cls, config_cls, full, tiny), inputs, dtype,
                     hf_loss, ("labels",), train, labels_to_model=True)


BF16 = torch.bfloat16
HF_MODELS: list[ModelSpec] = [
    # Encoders (masked LM heads over their full vocabularies).
    _text("hf_bert", "BertForMaskedLM", "BertConfig", {}, _mlm, 30522, (8, 512),
          train=True, optimizer="adamw"),
    _text("hf_roberta", "RobertaForMaskedLM", "RobertaConfig",
          dict(vocab_size=50265, max_position_embeddings=514), _mlm, 50265, (8, 512),
          tiny=dict(max_position_embeddings=66), train=True),
    _text("hf_distilbert", "DistilBertForMaskedLM", "DistilBertConfig", {}, _mlm, 30522,
          (16, 512), tiny=dict(dim=32, n_layers=2, n_heads=2, hidden_dim=64),
          train=True, optimizer="adamw"),
    _text("hf_electra", "ElectraForPreTraining", "ElectraConfig",
          dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072,
               embedding_size=768), _token_classes, 30522, (8, 512),
          tiny=dict(embedding_size=32), train=True),
    _text("hf_deberta_v2", "DebertaV2ForMaskedLM", "DebertaV2Config",
          dict(vocab_size=128100, relative_attention=True, position_buckets=256,
               pos_att_type=["p2c", "c2p"], max_relative_positions=-1,
               position_biased_input=False, norm_rel_ebd="layer_norm", share_att_key=True),
          _mlm, 128100, (8, 512),
          tiny=dict(relative_attention=True, position_buckets=16, pos_att_type=["p2c", "c2p"],
                    position_biased_input=False, share_att_key=True), train=True),
    _text("hf_albert", "AlbertForMaskedLM", "AlbertConfig",
          dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072), _mlm,
          30000, (8, 512), tiny=dict(embedding_size=16)),
    _text("hf_mobilebert", "MobileBertForMaskedLM", "MobileBertConfig", {}, _mlm, 30522,
          (8, 512), tiny=dict(embedding_size=16, intra_bottleneck_size=16,
                              true_hidden_size=16, num_feedforward_networks=2)),
    # Decoders: learned positions (GPT-2, OPT, Pythia), rotary with GQA (Llama, Qwen2),
    # sliding-window GQA (Mistral), multi-query (Gemma), partial rotary (Phi).
    _text("hf_gpt2", "GPT2LMHeadModel", "GPT2Config", {}, _causal, 50257, (8, 1024),
          tiny=_GPT2_TINY, train=True, optimizer="adamw"),
    _text("hf_opt", "OPTForCausalLM", "OPTConfig",
          dict(hidden_size=768, ffn_dim=3072, num_hidden_layers=12, num_attention_heads=12,
               vocab_size=50272, max_position_embeddings=2048, word_embed_proj_dim=768),
          _causal, 50272, (8, 1024), tiny=_OPT_TINY, dtype=torch.float16, train=True),
    _text("hf_llama", "LlamaForCausalLM", "LlamaConfig", _LLAMA_1B, _causal, 128256,
          (4, 1024), tiny=_GQA_TINY, dtype=BF16, train=True),
    _text("hf_qwen2", "Qwen2ForCausalLM", "Qwen2Config", _QWEN2_05B, _causal, 151936,
          (4, 1024), tiny=_GQA_TINY, dtype=BF16, train=True, optimizer="adamw"),
    _text("hf_mistral", "MistralForCausalLM", "MistralConfig", _MISTRAL_8L, _causal, 32000,
          (2, 2048), tiny={**_GQA_TINY, "sliding_window": 8}, dtype=BF16),
    _text("hf_gemma", "GemmaForCausalLM", "GemmaConfig", _GEMMA_2B, _causal, 256000,
          (2, 1024), tiny=dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16),
          dtype=BF16),
    _text("hf_phi", "PhiForCausalLM", "PhiConfig", _PHI_15, _causal, 51200, (4, 1024),
          tiny=dict(partial_rotary_factor=0.5), dtype=torch.float16),
    _text("hf_pythia", "GPTNeoXForCausalLM", "GPTNeoXConfig", _PYTHIA_410M, _causal, 50304,
          (8, 1024), tiny=dict(rotary_pct=0.25), dtype=torch.float16),
    # Encoder-decoders.
    _text("hf_t5", "T5ForConditionalGeneration", "T5Config", _T5_BASE, _seq2seq, 32128,
          (8, 512, 128), tiny=_T5_TINY, tiny_shape=(2, 16, 8), dtype=BF16, train=True),
    _text("hf_bart", "BartForConditionalGeneration", "BartConfig", _BART_BASE, _seq2seq,
          50265, (8, 512, 128), tiny=_BART_TINY, tiny_shape=(2, 16, 8), train=True),
    # Vision transformers.
    _vision("hf_vit", "ViTForImageClassification", "ViTConfig", dict(num_labels=1000),
            _VIT_TINY, (64, 224), train=True, optimizer="adamw"),
    _vision("hf_deit", "DeiTForImageClassification", "DeiTConfig", dict(num_labels=1000),
            _VIT_TINY, (64, 224)),
    _vision("hf_swin", "SwinForImageClassification", "SwinConfig", dict(num_labels=1000),
            _SWIN_TINY, (64, 224), train=True),
    _model("hf_clip", "CLIPModel", "CLIPConfig", {},
           dict(text_config=dict(_TINY_TEXT, max_position_embeddings=16),
                vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   intermediate_size=64, image_size=32, patch_size=8),
                projection_dim=16), _clip),
    _model("hf_segformer", "SegformerForSemanticSegmentation", "SegformerConfig",
           dict(num_labels=150),
           dict(num_labels=4, hidden_sizes=[8, 16, 16, 32], num_attention_heads=[1, 1, 2, 2],
                depths=[1, 1, 1, 1], decoder_hidden_size=32), _segformer),
    # Speech.
    _model("hf_whisper", "WhisperForConditionalGeneration", "WhisperConfig",
           dict(d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
                decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048),
           dict(vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2,
                encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16,
                max_target_positions=32, decoder_start_token_id=1, pad_token_id=0,
                bos_token_id=1, eos_token_id=2, suppress_tokens=[], begin_suppress_tokens=[]),
           _whisper, train=True),
    _model("hf_wav2vec2", "Wav2Vec2ForCTC", "Wav2Vec2Config",
           dict(ctc_loss_reduction="mean"),
           dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=64, conv_dim=(16, 16, 16), conv_stride=(5, 2, 2),
                conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16,
                num_conv_pos_embedding_groups=2, vocab_size=16, ctc_loss_reduction="mean"),
           _ctc, train=True),
]
