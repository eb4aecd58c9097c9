"""The transformer forwards step caching runs, one per family (`bcg.diffusers.step_caching.hook`).

Each `Family` names its diffusers transformer class, its blocks in order, one block's call and the model's
forward, op for op with diffusers' (0.42), with the blocks run by the step-cache hook (``hook._blocks``: the
first blocks, the middle ones behind the hook's break, the last ones). What a family's forward here does not
carry (`Family.bypass_args`: ControlNet residuals, IP-Adapter embeddings, a LoRA scale) runs the model's
own forward instead. `MiddleBlocks` is what a row that computes runs: the middle blocks as one module.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from bcg.runtime.signature import bind_positional, positional_names

__all__ = ["FAMILIES", "Family", "MiddleBlocks", "family_of"]


class MiddleBlocks(nn.Module):
    """The middle blocks as one module (shared with the transformer): what a row that computes runs."""

    def __init__(self, blocks: Sequence[nn.Module], family: "Family"):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.family = family

    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb, encoder_hidden_states_mask=None):
        for block in self.blocks:
            encoder_hidden_states, hidden_states = self.family.block(
                block, hidden_states, encoder_hidden_states, temb, image_rotary_emb, encoder_hidden_states_mask)
        return encoder_hidden_states, hidden_states


class Family:
    """How step caching runs one family's transformer (its diffusers class, or a subclass): its blocks in
    order, one block's call, and the forward (the family's own, op for op, with the middle blocks behind the
    hook's `_middle`). ``block`` returns ``(encoder_hidden_states, hidden_states)`` for every family (a text
    stream a block leaves alone is passed through); ``mask`` is the text mask per row (Qwen-Image's) or None."""

    name = ""
    classes: tuple = ()
    #: forward arguments that, given (not None, not empty), run the original forward, uncached (ControlNet
    #: residuals, IP-Adapter embeddings, a LoRA scale: what the family's forward here does not carry)
    bypass_args: tuple = ()

    def matches(self, module) -> bool:
        return any(c.__name__ in self.classes for c in type(module).__mro__)

    def bypasses(self, module, args, kwargs) -> bool:
        if args:   # positional arguments: named by the model's forward, as the runner names them
            kwargs = bind_positional(positional_names(module), args, kwargs)[1]
        return any(_given(kwargs.get(name)) for name in self.bypass_args)

    def blocks(self, module) -> list:
        raise NotImplementedError

    @staticmethod
    def block(block, h, e, temb, rot, mask=None):
        raise NotImplementedError

    def forward(self, hook, module, *args, **kwargs):
        raise NotImplementedError


def _returned(output: torch.Tensor, return_dict: bool):
    """What diffusers' transformers return: ``(output,)``, or its `Transformer2DModelOutput`."""
    if not return_dict:
        return (output,)
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    return Transformer2DModelOutput(sample=output)


def _given(value) -> bool:
    return value is not None and not (isinstance(value, (dict, list, tuple)) and not value)


class _Flux(Family):
    """`FluxTransformer2DModel` (diffusers 0.42): double-stream then single-stream blocks."""

    name = "flux"
    classes = ("FluxTransformer2DModel",)
    bypass_args = ("controlnet_block_samples", "controlnet_single_block_samples", "joint_attention_kwargs")

    def blocks(self, module) -> list:
        return [*module.transformer_blocks, *module.single_transformer_blocks]

    @staticmethod
    def block(block, h, e, temb, rot, mask=None):
        return block(hidden_states=h, encoder_hidden_states=e, temb=temb, image_rotary_emb=rot,
                     joint_attention_kwargs=None)

    def forward(self, hook, module, hidden_states, encoder_hidden_states=None, pooled_projections=None,
                timestep=None, img_ids=None, txt_ids=None, guidance=None, joint_attention_kwargs=None,
                controlnet_block_samples=None, controlnet_single_block_samples=None, return_dict=True,
                controlnet_blocks_repeat=False):
        """`FluxTransformer2DModel.forward`, op for op."""
        hidden_states = module.x_embedder(hidden_states)
        timestep = timestep.to(hidden_states.dtype) * 1000
        if guidance is not None:
            guidance = guidance.to(hidden_states.dtype) * 1000
        temb = (module.time_text_embed(timestep, pooled_projections) if guidance is None
                else module.time_text_embed(timestep, guidance, pooled_projections))
        encoder_hidden_states = module.context_embedder(encoder_hidden_states)
        if txt_ids.ndim == 3:
            txt_ids = txt_ids[0]
        if img_ids.ndim == 3:
            img_ids = img_ids[0]
        ids = torch.cat((txt_ids, img_ids), dim=0)
        image_rotary_emb = module.pos_embed(ids)

        encoder_hidden_states, hidden_states = hook._blocks(hidden_states, encoder_hidden_states, temb,
                                                            image_rotary_emb)
        hidden_states = module.norm_out(hidden_states, temb)
        output = module.proj_out(hidden_states)
        return _returned(output, return_dict)


class _Wan(Family):
    """`WanTransformer3DModel` (diffusers 0.42; Wan 2.1 and 2.2): one stream of blocks with cross-attention
    to the text, which the blocks leave unchanged."""

    name = "wan"
    classes = ("WanTransformer3DModel",)
    bypass_args = ("attention_kwargs",)

    def blocks(self, module) -> list:
        return list(module.blocks)

    @staticmethod
    def block(block, h, e, temb, rot, mask=None):
        return e, block(h, e, temb, rot)

    def forward(self, hook, module, hidden_states, timestep, encoder_hidden_states,
                encoder_hidden_states_image=None, return_dict=True, attention_kwargs=None):
        """`WanTransformer3DModel.forward`, op for op."""
        batch_size, _, num_frames, height, width = hidden_states.shape
        p_t, p_h, p_w = module.config.patch_size
        frames, rows, cols = num_frames // p_t, height // p_h, width // p_w
        rotary_emb = module.rope(hidden_states)
        hidden_states = module.patch_embedding(hidden_states)
        hidden_states = hidden_states.flatten(2).transpose(1, 2).contiguous()
        if timestep.ndim == 2:   # Wan 2.2 ti2v: a timestep per token
            ts_seq_len = timestep.shape[1]
            timestep = timestep.flatten()
        else:
            ts_seq_len = None
        temb, timestep_proj, encoder_hidden_states, encoder_hidden_states_image = module.condition_embedder(
            timestep, encoder_hidden_states, encoder_hidden_states_image, timestep_seq_len=ts_seq_len)
        timestep_proj = timestep_proj.unflatten(2 if ts_seq_len is not None else 1, (6, -1))
        if encoder_hidden_states_image is not None:
            encoder_hidden_states = torch.concat([encoder_hidden_states_image, encoder_hidden_states], dim=1)

        _, hidden_states = hook._blocks(hidden_states, encoder_hidden_states, timestep_proj, rotary_emb)

        if temb.ndim == 3:
            shift, scale = (module.scale_shift_table.unsqueeze(0).to(temb.device) + temb.unsqueeze(2)).chunk(2, dim=2)
            shift, scale = shift.squeeze(2), scale.squeeze(2)
        else:
            shift, scale = (module.scale_shift_table.to(temb.device) + temb.unsqueeze(1)).chunk(2, dim=1)
        shift, scale = shift.to(hidden_states.device), scale.to(hidden_states.device)
        hidden_states = (module.norm_out(hidden_states.float()) * (1 + scale) + shift).type_as(hidden_states)
        hidden_states = module.proj_out(hidden_states)
        hidden_states = hidden_states.reshape(batch_size, frames, rows, cols, p_t, p_h, p_w, -1)
        hidden_states = hidden_states.permute(0, 7, 1, 4, 2, 5, 3, 6)
        output = hidden_states.flatten(6, 7).flatten(4, 5).flatten(2, 3)
        return _returned(output, return_dict)


class _SD3(Family):
    """`SD3Transformer2DModel` (diffusers 0.42): joint blocks; the last one updates the image stream only."""

    name = "sd3"
    classes = ("SD3Transformer2DModel",)
    bypass_args = ("block_controlnet_hidden_states", "joint_attention_kwargs", "skip_layers")

    def blocks(self, module) -> list:
        return list(module.transformer_blocks)

    @staticmethod
    def block(block, h, e, temb, rot, mask=None):
        out_e, out_h = block(hidden_states=h, encoder_hidden_states=e, temb=temb, joint_attention_kwargs=None)
        return (e if out_e is None else out_e), out_h

    def forward(self, hook, module, hidden_states, encoder_hidden_states=None, pooled_projections=None,
                timestep=None, block_controlnet_hidden_states=None, joint_attention_kwargs=None,
                return_dict=True, skip_layers=None):
        """`SD3Transformer2DModel.forward`, op for op."""
        height, width = hidden_states.shape[-2:]
        hidden_states = module.pos_embed(hidden_states).contiguous()
        temb = module.time_text_embed(timestep, pooled_projections)
        encoder_hidden_states = module.context_embedder(encoder_hidden_states)
        _, hidden_states = hook._blocks(hidden_states, encoder_hidden_states, temb, None)
        hidden_states = module.norm_out(hidden_states, temb)
        hidden_states = module.proj_out(hidden_states)
        p = module.config.patch_size
        height, width = height // p, width // p
        hidden_states = hidden_states.reshape(shape=(hidden_states.shape[0], height, width, p, p, module.out_channels))
        hidden_states = torch.einsum("nhwpqc->nchpwq", hidden_states)
        output = hidden_states.reshape(shape=(hidden_states.shape[0], module.out_channels, height * p, width * p))
        return _returned(output, return_dict)


class _QwenImage(Family):
    """`QwenImageTransformer2DModel` (diffusers 0.42): joint blocks with a text mask per row."""

    name = "qwen-image"
    classes = ("QwenImageTransformer2DModel",)
    bypass_args = ("controlnet_block_samples", "attention_kwargs")

    def bypasses(self, module, args, kwargs) -> bool:
        # the edit models' ``zero_cond_t``: a timestep embedding with two rows per image
        return bool(module.zero_cond_t) or super().bypasses(module, args, kwargs)

    def blocks(self, module) -> list:
        return list(module.transformer_blocks)

    @staticmethod
    def block(block, h, e, temb, rot, mask=None):
        return block(hidden_states=h, encoder_hidden_states=e, encoder_hidden_states_mask=mask, temb=temb,
                     image_rotary_emb=rot, joint_attention_kwargs=None, modulate_index=None)

    def forward(self, hook, module, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None,
                timestep=None, img_shapes=None, guidance=None, attention_kwargs=None, controlnet_block_samples=None,
                additional_t_cond=None, return_dict=True):
        """`QwenImageTransformer2DModel.forward`, op for op."""
        hidden_states = module.img_in(hidden_states)
        timestep = timestep.to(hidden_states.dtype)
        encoder_hidden_states = module.txt_in(module.txt_norm(encoder_hidden_states))
        # diffusers' `compute_text_seq_len_from_mask`, less the per-row lengths its forward does not use (they
        # copy a host number to the device, which no graph can hold)
        text_seq_len = encoder_hidden_states.shape[1]
        if encoder_hidden_states_mask is not None:
            if encoder_hidden_states_mask.shape[:2] != encoder_hidden_states.shape[:2]:
                raise ValueError(f"`encoder_hidden_states_mask` shape {encoder_hidden_states_mask.shape} must match "
                                 f"(batch_size, text_seq_len)={tuple(encoder_hidden_states.shape[:2])}.")
            if encoder_hidden_states_mask.dtype != torch.bool:
                encoder_hidden_states_mask = encoder_hidden_states_mask.to(torch.bool)
        if guidance is not None:
            guidance = guidance.to(hidden_states.dtype) * 1000
        temb = (module.time_text_embed(timestep, hidden_states, additional_t_cond) if guidance is None
                else module.time_text_embed(timestep, guidance, hidden_states, additional_t_cond))
        image_rotary_emb = module.pos_embed(img_shapes, max_txt_seq_len=text_seq_len, device=hidden_states.device)
        _, hidden_states = hook._blocks(hidden_states, encoder_hidden_states, temb, image_rotary_emb,
                                        encoder_hidden_states_mask)
        hidden_states = module.norm_out(hidden_states, temb)
        output = module.proj_out(hidden_states)
        return _returned(output, return_dict)


FAMILIES = (_Flux(), _Wan(), _SD3(), _QwenImage())


def family_of(module) -> "Family | None":
    return next((f for f in FAMILIES if f.matches(module)), None)
