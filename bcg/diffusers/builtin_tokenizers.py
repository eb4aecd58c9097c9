"""Tokenizers of the built-in pipelines, built offline: byte-level BPE tokenizers trained in code on a
small built-in corpus (deterministic for one `tokenizers` version) and wrapped in
`transformers.PreTrainedTokenizerFast` (`build_tokenizer`); the Qwen chat style adds its special tokens, and
`build_qwen_vl_processor` makes Qwen-Image-Edit's processor (the Qwen2-VL tokenizer and image processor)."""
from __future__ import annotations

__all__ = ["build_qwen_vl_processor", "build_tokenizer"]

_CORPUS = """
a photo of a cat sitting on a red chair in a sunny room
an astronaut riding a horse on the moon, digital art, highly detailed
a watercolor painting of a mountain lake at sunrise with pine trees
a futuristic city at night with neon lights and flying cars, cinematic lighting
portrait of an old man with a white beard, oil painting, dramatic light
a bowl of fruit on a wooden table, still life, soft shadows
a small boat on a calm sea under a cloudy sky, minimalist photograph
a dog running through a field of flowers, golden hour, 4k, sharp focus
a castle on a hill surrounded by fog, fantasy illustration, trending on artstation
a close up of a blue butterfly on a green leaf, macro photography
a cozy cabin in the snowy forest with warm light in the windows
a robot reading a book in a library, studio lighting, octane render
a street market in the rain with colorful umbrellas and people walking
a bird flying over the ocean waves at sunset, wide angle, high resolution
a cup of coffee with latte art next to a laptop, shallow depth of field
a video of a fox walking in the snow, the camera slowly pans to the left
a timelapse of clouds moving over a desert, the sun goes down, stars appear
a woman in a yellow dress dancing in the street, people watching, slow motion
simple black and white line drawing of a house, a tree and the sun
"""

# Qwen-Image wraps every prompt in a chat template and drops the embeddings of its first
# `QwenImagePipeline.prompt_template_encode_start_idx` (34) tokens: the `qwen` tokenizer learns this system
# line too, so the template's prefix is 34 tokens here as in Qwen's own tokenizer (one per word or mark).
_QWEN_SYSTEM = (
    "Describe the image by detailing the color, shape, size, texture, quantity, text, spatial relationships of "
    "the objects and background:"
)
_QWEN_SPECIALS = ("<|im_start|>", "<|im_end|>")
# Qwen-Image-Edit's template: its own system line (64 tokens to the user's turn, as the pipeline drops) and the
# image between vision tokens (`<|image_pad|>`, which the processor repeats once per image token)
_QWEN_EDIT_SYSTEM = (
    "Describe the key features of the input image (color, shape, size, texture, objects, background), then "
    "explain how the user's text instruction should alter or modify the image. Generate a new image that meets "
    "the user's requirements while maintaining consistency with the original input where appropriate."
)
_QWEN_VISION = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")


def _train_bpe(vocab_size: int = 512, chat: bool = False, vision: bool = False):
    """Byte-level BPE on the corpus; `chat`: Qwen's framing (no prefix space, chat specials, system line);
    `vision`: Qwen-Image-Edit's too (its system line, the vision specials)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=not chat)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "</s>", "<s>", "<unk>", *(_QWEN_SPECIALS if chat else ()),
                        *(_QWEN_VISION if vision else ())],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line.strip() for line in _CORPUS.strip().splitlines()]
    if chat:
        lines += [f"<|im_start|>system\n{_QWEN_SYSTEM}<|im_end|>\n<|im_start|>user\n{line}<|im_end|>\n"
                  "<|im_start|>assistant\n" for line in lines]
    if vision:
        lines += [f"<|im_start|>system\n{_QWEN_EDIT_SYSTEM}<|im_end|>\n<|im_start|>user\n{''.join(_QWEN_VISION)}"
                  f"{line}<|im_end|>\n<|im_start|>assistant\n" for line in lines[:len(lines) // 2]]
    tok.train_from_iterator(lines * 4, trainer)
    return tok


def build_tokenizer(style: str, model_max_length: int):
    """A PreTrainedTokenizerFast with CLIP (`<s> x </s>`), T5 (`x </s>`), Gemma (`<s> x`) or Qwen framing.

    Ids: `<pad>`=0, `</s>`=1, `<s>`=2, `<unk>`=3. `vocab_size` of the result is what text encoders need.
    `qwen` adds no tokens (the pipeline's chat template frames the prompt); it knows `<|im_start|>`=4 and
    `<|im_end|>`=5, has 640 tokens and no prefix space, like Qwen2's tokenizer. `qwen-vl` is `qwen` with
    Qwen-Image-Edit's system line and ``<|vision_start|>``=6, ``<|image_pad|>``=7, ``<|vision_end|>``=8 (700
    tokens).
    """
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    templates = {
        "clip": ("<s> $A </s>", [("<s>", 2), ("</s>", 1)]),
        "t5": ("$A </s>", [("</s>", 1)]),
        "gemma": ("<s> $A", [("<s>", 2)]),
        "qwen": ("$A", []),
        "qwen-vl": ("$A", []),
    }
    if style not in templates:
        raise ValueError(f"tokenizer style must be one of {sorted(templates)}, got {style!r}")
    chat, vision = style.startswith("qwen"), style == "qwen-vl"
    tok = _train_bpe(700 if vision else 640, chat=True, vision=vision) if chat else _train_bpe()
    specials = {"<pad>": 0, "</s>": 1, "<s>": 2} | ({"<|im_start|>": 4, "<|im_end|>": 5} if chat else {}) \
        | (dict(zip(_QWEN_VISION, (6, 7, 8))) if vision else {})
    single, special_tokens = templates[style]
    assert all(tok.token_to_id(name) == idx for name, idx in specials.items())
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=special_tokens)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="</s>",
        bos_token="<s>",
        unk_token="<unk>",
        model_max_length=model_max_length,
        padding_side="right",
        **({"additional_special_tokens": list(_QWEN_SPECIALS + (_QWEN_VISION if vision else ()))} if chat else {}),
    )


def build_qwen_vl_processor(max_image_tokens: int = 16):
    """Qwen-Image-Edit's ``processor``: a ``Qwen2VLProcessor`` over the `qwen-vl` tokenizer and a Qwen2-VL image
    processor that makes at most `max_image_tokens` image tokens of an image (28 pixels a token side), without
    transformers' video processor (it needs torchvision; the pipeline sends no video)."""
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    class ImageTextQwen2VLProcessor(Qwen2VLProcessor):
        """``Qwen2VLProcessor`` of images and text (no video processor)."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    image_processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=max_image_tokens * 28 * 28)
    return ImageTextQwen2VLProcessor(image_processor=image_processor, tokenizer=build_tokenizer("qwen-vl", 2048))
