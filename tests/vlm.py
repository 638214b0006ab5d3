"""A tiny vision-language model made at test time (no download), its reference, and images.

Idefics3 (SmolVLM's architecture): a SigLIP-style vision tower, a pixel-shuffle connector and a
Llama decoder, all with random weights, and a real processor config (Idefics3Processor with
Pillow's image processor, no image splitting) over a word-level tokenizer. vLLM's CPU build
runs it; LLaVA, Qwen2-VL and Gemma3 it cannot here: their vLLM modules import torchvision, which
the CPU torch cannot load (PyPI's wheel: "operator torchvision::nms does not exist").
"""

from __future__ import annotations

import functools
import io
import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

VOCAB = 512
SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
            "<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]
IMAGE_TOKEN = 7
IMAGE_SEQ_LEN = 16
"""Embeddings per image: (64 / 8)^2 patches, pixel-shuffled by 2 x 2."""
IMAGE_PROMPT_TOKENS = IMAGE_SEQ_LEN + 3
"""What one `<image>` expands to: <fake_token_around_image> <global-img> <image> x 16 <fake_...>."""
# Content parts as vLLM hands them to templates ("openai" format): {"type": "image"} / "text".
TEMPLATE = ("{{ bos_token }}{%- for m in messages %}<|{{ m.role }}|>"
            "{%- if m.content is string %} {{ m.content }}{% else %}{% for c in m.content %}"
            "{% if c.type == 'image' %} <image>{% elif c.type == 'text' %} {{ c.text }}{% endif %}"
            "{% endfor %}{% endif %} <|end|>{%- endfor %}"
            "{%- if add_generation_prompt %}<|assistant|>{% endif %}")


def make_vlm(path: Path, *, seed: int = 0) -> Path:
    """Idefics3 with a 2-layer Llama (head_dim 64: vLLM's CPU attention rejects 16) and a 2-layer
    vision tower on 64 x 64 images, float32 safetensors, with its processor and tokenizer."""
    import torch
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor,
                              PreTrainedTokenizerFast)
    from transformers.models.idefics3 import Idefics3ImageProcessorPil

    torch.manual_seed(seed)
    text = dict(model_type="llama", vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                  image_size=64, patch_size=8)
    config = Idefics3Config(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN,
                            scale_factor=2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                            pad_token_id=0)
    Idefics3ForConditionalGeneration(config).save_pretrained(path)
    vocab = {name: i for i, name in enumerate(SPECIALS)}
    vocab |= {f"w{i}": i for i in range(len(SPECIALS), VOCAB)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>", pad_token="<unk>",
                                        extra_special_tokens={"image_token": "<image>"},
                                        chat_template=TEMPLATE)
    tokenizer.save_pretrained(path)
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": 64},
                                       max_image_size={"longest_edge": 64})
    Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=IMAGE_SEQ_LEN,
                      chat_template=TEMPLATE).save_pretrained(path)
    return path


class Reference:
    """The float32 transformers model and processor the engine is checked against."""

    def __init__(self, path: Path):
        import torch
        from transformers import AutoProcessor, Idefics3ForConditionalGeneration

        self.processor = AutoProcessor.from_pretrained(path)
        self.model = Idefics3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()

    def inputs(self, text: str, images: list[Image.Image]) -> dict:
        return self.processor(text=text, images=[images], return_tensors="pt")

    def chat_text(self, messages: list[dict]) -> str:
        return self.processor.apply_chat_template(messages, add_generation_prompt=True)

    def greedy(self, text: str, images: list[Image.Image], max_tokens: int) -> tuple[list[int], list[int]]:
        """(prompt ids, greedy completion); like vLLM it ends with EOS when EOS is the argmax."""
        import torch

        inputs = self.inputs(text, images)
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False,
                                      pad_token_id=0, eos_token_id=2)
        prompt = inputs["input_ids"][0].tolist()
        return prompt, out[0, len(prompt):].tolist()


def noise_image(seed: int, size: tuple[int, int] = (48, 40)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def encoded(image: Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **kwargs)
    return out.getvalue()


# --- hostile files -------------------------------------------------------------------------------

def png_bomb(side: int = 50_000) -> bytes:
    """A valid side x side 1-bit PNG of zeros: ~300 KB on the wire, 2.5 G pixels decoded (Pillow
    holds a byte per pixel: 2.5 GB). Written chunk by chunk: a file, not a decoder."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\x00" * (1 + (side + 7) // 8)  # filter byte + packed bits
    z = zlib.compressobj(9)
    idat = b"".join(z.compress(row) for _ in range(side)) + z.flush()
    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)  # 1-bit grayscale
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


@functools.cache
def hostile_images() -> dict[str, bytes]:
    jpeg = encoded(noise_image(7, (64, 64)), "JPEG", quality=90)
    return {
        "png bomb": png_bomb(),
        "truncated jpeg": jpeg[: len(jpeg) // 2],
        "gif": encoded(noise_image(8, (16, 16)).convert("P"), "GIF"),
        "random bytes": np.random.default_rng(9).bytes(4096),
        "svg": b'<svg xmlns="http://www.w3.org/2000/svg" width="50000" height="50000">'
               b'<rect width="100%" height="100%"/></svg>',
    }
