"""Tiny random models (GPT-2, Llama, GPT-NeoX/Pythia, Mamba) built from configs, saved to folders, plus a registry.

A small byte-level BPE tokenizer is trained on the embedded corpus so the models' folders are
complete transformers checkpoints that load offline like any user's local model.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MambaConfig,
    MambaForCausalLM,
    PreTrainedTokenizerFast,
)

from updatelens.corpus import read_embedded_wiki

VOCAB = 512
D_MODEL = 32
N_LAYERS = 3
CONTEXT = 64


def train_tokenizer(folder: Path) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(read_embedded_wiki()[:40], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)
    return fast


def configs() -> dict[str, object]:
    return {
        "tiny-gpt2": GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=D_MODEL, n_layer=N_LAYERS,
                                n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        "tiny-llama": LlamaConfig(vocab_size=VOCAB, hidden_size=D_MODEL, intermediate_size=64,
                                  num_hidden_layers=N_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=CONTEXT),
        "tiny-neox": GPTNeoXConfig(vocab_size=VOCAB, hidden_size=D_MODEL, intermediate_size=64,
                                   num_hidden_layers=N_LAYERS, num_attention_heads=4, max_position_embeddings=CONTEXT),
        "tiny-mamba": MambaConfig(vocab_size=VOCAB, hidden_size=D_MODEL, state_size=8,
                                  num_hidden_layers=N_LAYERS, expand=2, conv_kernel=4),
    }


MODEL_CLASSES = {"tiny-gpt2": GPT2LMHeadModel, "tiny-llama": LlamaForCausalLM, "tiny-neox": GPTNeoXForCausalLM,
                 "tiny-mamba": MambaForCausalLM}


def build_zoo(root: Path) -> Path:
    """Save the three tiny models under root and write root/registry.toml; returns its path."""
    tok_dir = root / "tokenizer"
    tokenizer = train_tokenizer(tok_dir)
    lines = []
    for i, (slug, config) in enumerate(configs().items()):
        torch.manual_seed(1234 + i)
        model = MODEL_CLASSES[slug](config)
        folder = root / slug
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        lines.append(f'[models.{slug}]\nsource = "local"\npath = "{folder}"\n')
    lines.append('[corpora.wiki-embedded]\nsource = "embedded"\n')
    registry = root / "registry.toml"
    registry.write_text("\n".join(lines))
    return registry
