"""Models of the libraries users bring, built from tiny configs (no download): Hugging Face transformers
(BERT, DistilBERT, GPT-2 with its tied embedding, Llama, ViT) and timm (resnet10t, mobilenetv3, convnext_atto,
vit_tiny, mixer) when it imports.

timm imports torchvision, and PyPI's torchvision wheel is built for CUDA torch: beside the CPU torch of this
project it fails at import ("operator torchvision::nms does not exist"), so ``TIMM`` is None and the timm
cases skip with that reason (``timm_or_skip``). Every model returns one (N, classes) tensor, read by the
cross-entropy; token models take int64 ids in [1, vocab) (0 is BERT's padding row, see
``test_hf_zoo.test_padding_row``); every parameter gets seeded noise (``zoo.models.perturb``), so that no two
are equal tensors an exporter would merge.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from zoo.models import export, perturb

nn = torch.nn
VOCAB, SEQ, CLASSES = 24, 8, 3


def _import_timm():
    try:
        import timm
    except Exception as exc:  # NOTE: RuntimeError from torchvision's import, or timm not installed
        return None, f"timm does not import here ({type(exc).__name__}: {str(exc)[:120]})"
    return timm, ""


TIMM, TIMM_REASON = _import_timm()


class _Classifier(nn.Module):
    """``model(ids)`` as (N, classes) logits: sequence classifiers as they are, a causal LM's last position."""

    def __init__(self, model: nn.Module, kind: str):
        super().__init__()
        self.model, self.kind = model, kind

    def forward(self, x):
        if self.kind == "image":
            out = self.model(pixel_values=x) if hasattr(self.model, "config") else self.model(x)
            return getattr(out, "logits", out)
        # NOTE: an explicit all-ones mask: without one transformers computes packed-sequence indices with
        # aten::diff, which TorchScript cannot export
        out = self.model(input_ids=x, attention_mask=torch.ones_like(x), **({"use_cache": False} if self.kind == "lm"
                                                                          else {}))
        return out.logits[:, -1, :CLASSES] if self.kind == "lm" else out.logits


def _hf(name: str) -> nn.Module:
    import transformers as T

    common = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=CLASSES)
    if name == "bert":
        cfg = T.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=32, max_position_embeddings=SEQ, **common)
        model, kind = T.BertForSequenceClassification(cfg), "text"
    elif name == "distilbert":
        cfg = T.DistilBertConfig(vocab_size=VOCAB, dim=16, n_layers=1, n_heads=2, hidden_dim=32,
                                 max_position_embeddings=SEQ, dropout=0.0, attention_dropout=0.0,
                                 seq_classif_dropout=0.0, num_labels=CLASSES)
        model, kind = T.DistilBertForSequenceClassification(cfg), "text"
    elif name == "gpt2":
        cfg = T.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                           embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1)
        model, kind = T.GPT2LMHeadModel(cfg), "lm"
    elif name == "llama":  # NOTE: RMS norms, SiLU gates and a rotary table the dynamo export folds to constants
        cfg = T.LlamaConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, intermediate_size=32, max_position_embeddings=SEQ,
                            bos_token_id=1, eos_token_id=1, pad_token_id=0)
        model, kind = T.LlamaForCausalLM(cfg), "lm"
    elif name == "vit":
        cfg = T.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
                          num_attention_heads=2, intermediate_size=32, **common)
        model, kind = T.ViTForImageClassification(cfg), "image"
    else:
        raise KeyError(name)
    model.config._attn_implementation = "eager"  # NOTE: sdpa's mask handling differs per exporter
    return _Classifier(model, kind)


def _timm(name: str, **kwargs):
    return lambda: TIMM.create_model(name, pretrained=False, num_classes=CLASSES, **kwargs)


TIMM_MODELS = {"resnet10t": _timm("resnet10t"), "mobilenetv3": _timm("mobilenetv3_small_050"),
               "convnext_atto": _timm("convnext_atto"),
               "vit_tiny": _timm("vit_tiny_patch16_224", img_size=16, patch_size=8, depth=1),
               # NOTE: mixer_s16_224 fixes its patch size and depth: the class itself, tiny
               "mixer": lambda: TIMM.models.mlp_mixer.MlpMixer(num_classes=CLASSES, img_size=16, patch_size=8,
                                                               num_blocks=1, embed_dim=32)}
HF_MODELS = ["bert", "distilbert", "gpt2", "llama", "vit"]
# NOTE: convnext_atto downsamples by 32 (its last 2x2 downsampling needs 2x2 left)
IMAGE_SHAPE = {"vit": (3, 8, 8), **{name: (3, 16, 16) for name in TIMM_MODELS}, "convnext_atto": (3, 32, 32)}


def make_module(name: str) -> nn.Module:
    """The model ``name`` in eval mode, seeded, every parameter perturbed (GPT-2's tie kept)."""
    torch.manual_seed(0)
    if name in TIMM_MODELS:
        module = _Classifier(TIMM_MODELS[name](), "image")
    else:
        module = _hf(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return perturb(module).eval()


def make_data(name: str, n: int = 32, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Inputs (ids in [1, VOCAB) or images) and class targets from a fixed teacher."""
    rng = np.random.default_rng(seed)
    if name in IMAGE_SHAPE:
        X = rng.normal(size=(n, *IMAGE_SHAPE[name])).astype(np.float32)
        flat = X.reshape(n, -1)
    else:
        X = rng.integers(1, VOCAB, size=(n, SEQ)).astype(np.int64)
        flat = np.eye(VOCAB)[X].mean(axis=1)
    teacher = np.random.default_rng(123).normal(size=(flat.shape[1], CLASSES))
    return X, (flat @ teacher).argmax(axis=1).astype(np.int64)


_EXPORTS: dict = {}


def exported(name: str, exporter: str):
    """The export of ``make_module(name)`` by ``exporter`` ("dynamo", "script" or "script_train": BatchNorm
    kept, not folded into the convolutions), made once per session."""
    import onnx

    if (name, exporter) not in _EXPORTS:
        module = make_module(name)
        proto = export(module, make_data(name, n=4)[0], exporter)
        # NOTE: a training-mode export runs the module once: its BatchNorm statistics moved, as in the ONNX
        _EXPORTS[name, exporter] = proto, {k: v.clone() for k, v in module.state_dict().items()}
    out = onnx.ModelProto()
    out.CopyFrom(_EXPORTS[name, exporter][0])
    return out


def exported_module(name: str, exporter: str) -> nn.Module:
    """``make_module(name)`` in eval mode as it was right after its export (the state the ONNX model holds)."""
    exported(name, exporter)
    module = make_module(name)
    module.load_state_dict(_EXPORTS[name, exporter][1])
    return module.eval()
