"""ConViT models (d'Ascoli et al., ch. 7) and their DeiT+ baselines, registered in timm's registry.

A ConViT is a ViT whose first `local_up_to_layer` blocks (10 of 12) use gated positional
self-attention (GPSA) initialized as a convolution; the class token joins the patch tokens only after
the last GPSA block, and the absolute position embedding is kept. With `local_up_to_layer=0` the same
class is the DeiT+ baseline of Table 7.1.

State-dict keys and shapes are those of `timm.models.convit` and of the official checkpoints, so
weights load both ways. The constructor's kwargs keep timm's meaning (`embed_dim` is the width per
head, 48 for ConViT-Ti: width 48 x 4 = 192). Unlike timm's `ConVit`, the model runs at any input size
whose sides are multiples of the patch size (rectangular grids too): GPSA rebuilds its relative encodings for the token grid and the absolute
position embedding is resampled.

The initialization is the official code's and timm's: for the same seed a `ConViT` starts from the
same parameters as timm's `ConVit` with the same kwargs (the order of random draws is theirs). The
convolutional init centers an even kernel's heads on half-integers (`conv_init="paper"`, the default);
`conv_init="integer"` gives each head one target pixel instead (`convbias.gpsa.kernel_offsets`).

Ablations of Table 7.3 are constructor kwargs (`conv_init`, `train_gating`, `train_gpsa`,
`local_up_to_layer`); the test-time masks of App. F.6 (Tables F.2, F.3) are `set_test_masks` (also
reachable as kwargs for evaluation runs).
"""

import inspect
import math
import warnings
from typing import Any

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import (
    DropPath,
    LayerNorm,
    Mlp,
    PatchEmbed,
    calculate_drop_path_rates,
    register_notrace_function,
    resample_abs_pos_embed,
    to_2tuple,
    trunc_normal_,
)
from timm.models import build_model_with_cfg, checkpoint, generate_default_cfgs, register_model
from torch import nn
from torch.fx._symbolic_trace import is_fx_symbolic_tracing

from convbias.base.timm_compat import feature_take_indices

from .attention import CONV_INITS, GPSA, MHSA, GridSize, LayerOperands, shared_operands

__all__ = ["Block", "ConViT", "PoolError", "checkpoint_filter_fn"]

GLOBAL_POOLS = ("token", "avg", "")


class PoolError(ValueError, AssertionError):
    """A global pool the model cannot use: a ValueError (this project's convention) that is also the
    AssertionError timm's ViT-like models raise for it."""


class Block(nn.Module):
    """Pre-norm transformer block; its attention is GPSA (patch tokens only) or plain MHSA."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = False,
        proj_drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        act_layer: type[nn.Module] = nn.GELU,
        norm_layer: type[nn.Module] = LayerNorm,
        use_gpsa: bool = True,
        locality_strength: float = 1.0,
    ):
        super().__init__()
        self.use_gpsa = use_gpsa
        self.norm1 = norm_layer(dim)
        if use_gpsa:
            self.attn = GPSA(dim, num_heads, qkv_bias, attn_drop, proj_drop, locality_strength)
        else:
            self.attn = MHSA(dim, num_heads, qkv_bias, attn_drop, proj_drop)
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act_layer, drop=proj_drop)

    def forward(self, x: torch.Tensor, grid_size: GridSize, shared: LayerOperands | None = None) -> torch.Tensor:
        """shared: the GPSA layer's operands if computed with the other layers' (`shared_operands`)."""
        x = x + self.drop_path(self.attn(self.norm1(x), grid_size, shared))
        return x + self.drop_path(self.mlp(self.norm2(x)))


@register_notrace_function  # FX: a leaf (its check is a Python branch on the input size)
def token_grid(height: int, width: int, patch_h: int, patch_w: int) -> tuple[int, int]:
    """Token grid of an input of this size; a ValueError if a side is not a multiple of the patch."""
    if height % patch_h != 0 or width % patch_w != 0:
        raise ValueError(
            f"input size ({height}, {width}) must be a multiple of patch_size=({patch_h}, {patch_w}) on each side"
        )
    return height // patch_h, width // patch_w


@register_notrace_function  # FX: a leaf (Python branch on the grid)
def pos_embed_for_grid(
    pos_embed: torch.Tensor, grid_size: tuple[int, int], built_grid: tuple[int, int]
) -> torch.Tensor:
    """The absolute position embedding, resampled (bicubic) when the grid differs from the built one."""
    if grid_size[0] == built_grid[0] and grid_size[1] == built_grid[1]:
        return pos_embed
    return resample_abs_pos_embed(
        pos_embed, new_size=[grid_size[0], grid_size[1]], old_size=[built_grid[0], built_grid[1]], num_prefix_tokens=0
    )


def _conv_init_name(conv_init: bool | str) -> str:
    """`conv_init` as one of CONV_INITS or "none" (True is "paper", False "none")."""
    if isinstance(conv_init, bool):
        return "paper" if conv_init else "none"
    if conv_init not in (*CONV_INITS, "none"):
        raise ValueError(f"conv_init={conv_init!r} must be one of {(*CONV_INITS, 'none')} (or True / False)")
    return conv_init


def _check_config(
    img_size: tuple[int, int],
    patch_size: tuple[int, int],
    embed_dim: int,
    depth: int,
    num_heads: int,
    global_pool: str,
    local_up_to_layer: int,
    locality_strength: float,
) -> None:
    """Reject a configuration that would otherwise fail as a shape error inside the forward."""
    if embed_dim < 1 or num_heads < 1:
        raise ValueError(f"embed_dim={embed_dim} (per head) and num_heads={num_heads} must be >= 1")
    if min(patch_size) < 1:
        raise ValueError(f"patch_size={patch_size} must be positive")
    if min(img_size) < 1 or img_size[0] % patch_size[0] or img_size[1] % patch_size[1]:
        raise ValueError(
            f"img_size={img_size} must be a positive multiple of patch_size={patch_size} on each side, "
            f"e.g. {tuple(max(1, s // p) * p for s, p in zip(img_size, patch_size))}"
        )
    if depth < 1:
        raise ValueError(f"depth={depth} must be >= 1")
    if not 0 <= local_up_to_layer <= depth:
        raise ValueError(f"local_up_to_layer={local_up_to_layer} must be in 0..depth={depth} (0 gives a DeiT)")
    if global_pool not in GLOBAL_POOLS:
        raise ValueError(f"global_pool={global_pool!r} must be one of {GLOBAL_POOLS}")
    if global_pool == "token" and local_up_to_layer == depth:
        raise ValueError(
            f"local_up_to_layer={local_up_to_layer} leaves no block after the GPSA blocks for the class token; "
            f"use local_up_to_layer < depth={depth} or global_pool='avg'"
        )
    if not locality_strength > 0:
        raise ValueError(f"locality_strength={locality_strength} must be > 0")


class ConViT(nn.Module):
    """Vision transformer with `local_up_to_layer` GPSA blocks, then SA blocks with the class token.

    `conv_init`: "paper" (Eq. 7.5 with the official code's kernel: half-integer centers for an even
    kernel, as timm), "integer" (integer centers, one target pixel per head: `kernel_offsets`), or
    "none" / False (random GPSA init instead of Eq. 7.5); True means "paper".
    Ablation switches (Table 7.3): `local_up_to_layer=0` (no GPSA: a DeiT), `conv_init=False`, `train_gating=False` (lambda frozen at 0, so content and
    position get equal weight: footnote 4), `train_gpsa=False` (the GPSA attention modules are frozen,
    only their blocks' norms and MLPs train). Test-time masks (App. F.6): `mask_pos_embed`,
    `mask_content_layers`, `mask_position_layers`; see `set_test_masks`.
    """

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int | tuple[int, int] = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: str = "token",
        embed_dim: int = 48,
        depth: int = 12,
        num_heads: int = 4,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = False,
        drop_rate: float = 0.0,
        pos_drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        local_up_to_layer: int = 10,
        locality_strength: float = 1.0,
        use_pos_embed: bool = True,
        conv_init: bool | str = "paper",
        train_gating: bool = True,
        train_gpsa: bool = True,
        mask_pos_embed: bool = False,
        mask_content_layers: int = 0,
        mask_position_layers: int = 0,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        conv_init = _conv_init_name(conv_init)
        img_size, patch_size = to_2tuple(img_size), to_2tuple(patch_size)
        _check_config(
            img_size, patch_size, embed_dim, depth, num_heads, global_pool, local_up_to_layer, locality_strength
        )
        embed_dim *= num_heads  # per head in the arguments, as timm's ConVit; the full width from here on
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.global_pool = global_pool
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.local_up_to_layer = local_up_to_layer
        self.locality_strength = locality_strength
        self.use_pos_embed = use_pos_embed
        # the class token joins after the GPSA blocks; with GPSA in every block it never joins
        self.num_prefix_tokens = 1 if local_up_to_layer < depth else 0
        self.grad_checkpointing = False

        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim, strict_img_size=False)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if self.num_prefix_tokens else None
        self.pos_embed = (
            nn.Parameter(torch.zeros(1, self.patch_embed.num_patches, embed_dim)) if use_pos_embed else None
        )
        if self.pos_embed is not None:  # drawn here, before the blocks exist: timm's order of random draws
            trunc_normal_(self.pos_embed, std=0.02)
        self.pos_drop = nn.Dropout(pos_drop_rate)
        drop_path_rates = calculate_drop_path_rates(drop_path_rate, depth)
        self.blocks = nn.ModuleList(
            Block(
                embed_dim,
                num_heads,
                mlp_ratio,
                qkv_bias,
                proj_drop=proj_drop_rate,
                attn_drop=attn_drop_rate,
                drop_path=drop_path_rates[i],
                use_gpsa=i < local_up_to_layer,
                locality_strength=locality_strength,
            )
            for i in range(depth)
        )
        self.norm = LayerNorm(embed_dim)
        reduction = self.patch_embed.feat_ratio()
        self.feature_info = [dict(num_chs=embed_dim, reduction=reduction, module=f"blocks.{i}") for i in range(depth)]
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()

        self._init_weights(conv_init)
        if not train_gating:
            for layer in self.gpsa_layers():
                layer.gating_param.data.zero_()
                layer.gating_param.requires_grad_(False)
        if not train_gpsa:
            for layer in self.gpsa_layers():
                layer.requires_grad_(False)
        self.set_test_masks(mask_pos_embed, mask_content_layers, mask_position_layers)
        if device is not None or dtype is not None:
            self.to(device=device, dtype=dtype)

    def _init_weights(self, conv_init: str) -> None:
        """timm's `ConVit` init, in its order: class token, every Linear (the patch embedding's conv keeps
        PyTorch's default init, as theirs), then the convolutional init of the GPSA layers."""
        if self.cls_token is not None:
            trunc_normal_(self.cls_token, std=0.02)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        if conv_init != "none":
            for layer in self.gpsa_layers():
                layer.local_init(offsets=conv_init)

    # -- switches -------------------------------------------------------------------------------
    def gpsa_layers(self) -> list[GPSA]:
        """The GPSA attention modules, first block first."""
        return [block.attn for block in self.blocks if block.use_gpsa]

    def set_test_masks(self, pos_embed: bool = False, content_layers: int = 0, position_layers: int = 0) -> None:
        """Test-time masks of App. F.6; calling it again replaces the previous masks.

        pos_embed: drop the absolute position embedding (Table F.2).
        content_layers: in the first k GPSA layers, sigma(lambda) := 1, attention on position only
            ("mask content", Table F.3).
        position_layers: in the first k GPSA layers, sigma(lambda) := 0, attention on content only
            ("mask position", Table F.3).
        """
        num_gpsa = self.local_up_to_layer
        for name, k in (("mask_content_layers", content_layers), ("mask_position_layers", position_layers)):
            if not 0 <= k <= num_gpsa:
                raise ValueError(f"{name}={k} must be in 0..{num_gpsa} (the number of GPSA layers)")
        if content_layers and position_layers:
            raise ValueError(
                f"mask_content_layers={content_layers} and mask_position_layers={position_layers}: "
                "mask content or position, not both (set one of them to 0)"
            )
        self.mask_pos_embed = bool(pos_embed)
        for i, layer in enumerate(self.gpsa_layers()):
            layer.gate_override = 1.0 if i < content_layers else 0.0 if i < position_layers else None

    # -- timm model interface -------------------------------------------------------------------
    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        return {"pos_embed", "cls_token"}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        return dict(stem=r"^cls_token|pos_embed|patch_embed", blocks=[(r"^blocks\.(\d+)", None), (r"^norm", (99999,))])

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        if global_pool is not None:
            if global_pool not in GLOBAL_POOLS or (global_pool == "token" and not self.num_prefix_tokens):
                allowed = GLOBAL_POOLS if self.num_prefix_tokens else ("avg", "")
                raise PoolError(f"global_pool={global_pool!r} must be one of {allowed} for this model")
            self.global_pool = global_pool
        self.num_classes = num_classes
        weight = self.patch_embed.proj.weight
        head = (
            nn.Linear(self.embed_dim, num_classes, device=weight.device, dtype=weight.dtype)
            if num_classes > 0
            else nn.Identity()
        )
        self.head = head.train(self.training)  # a new head follows the model's mode (timm's contract)

    # -- forward --------------------------------------------------------------------------------
    def grid_size(self, img_size: list[int]) -> GridSize:
        """Token grid (Hp, Wp) of an (H, W) input; a ValueError if a side is not a multiple of the patch."""
        return token_grid(img_size[0], img_size[1], self.patch_embed.patch_size[0], self.patch_embed.patch_size[1])

    def _pos_embed(self, grid_size: GridSize) -> torch.Tensor:
        return pos_embed_for_grid(self.pos_embed, grid_size, self.patch_embed.grid_size)

    def _embed(self, x: torch.Tensor, grid_size: GridSize) -> torch.Tensor:
        # The patch embedding returns a transposed view (memory ordered B, C, N). Made contiguous once
        # here: otherwise every residual add keeps that layout and every LayerNorm of the GPSA blocks
        # (no class-token concat comes to fix it until after them) copies its input, forward and backward.
        x = self.patch_embed(x).contiguous()
        if self.pos_embed is not None and not self.mask_pos_embed:
            x = x + self._pos_embed(grid_size)
        return self.pos_drop(x)

    def _join_cls_token(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Before block `index`: prepend the class token if it is the first block after the GPSA blocks."""
        if index == self.local_up_to_layer and self.cls_token is not None:
            x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        return x

    def _shared_operands(self, grid_size: GridSize) -> list[LayerOperands] | None:
        """The GPSA layers' operands computed at once (`shared_operands`), or None where each layer computes
        its own: under FX tracing (GPSA is a leaf there) and with gradient checkpointing (a reentrant
        checkpoint passes only top-level tensors on to the backward)."""
        if self.grad_checkpointing or is_fx_symbolic_tracing():
            return None
        return shared_operands(self.gpsa_layers(), grid_size)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        grid_size = self.grid_size(x.shape[-2:])
        x = self._embed(x, grid_size)
        if torch.jit.is_scripting():
            for i, block in enumerate(self.blocks):
                x = block(self._join_cls_token(i, x), grid_size)
            return self.norm(x)
        shared = self._shared_operands(grid_size)
        for i, block in enumerate(self.blocks):
            x = self._join_cls_token(i, x)
            if self.grad_checkpointing:
                x = checkpoint(block, x, grid_size)
            else:
                x = block(x, grid_size, None if shared is None or i >= len(shared) else shared[i])
        return self.norm(x)

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: int | list[int] | None = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
        """timm's feature API: outputs of the blocks in `indices` (patch tokens only, class token
        removed), as (B, C, Hp, Wp) maps (NCHW) or (B, N, C) sequences (NLC)."""
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt='{output_fmt}' must be 'NCHW' or 'NLC'")  # TorchScript has no !r
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        batch = x.shape[0]
        grid_size = self.grid_size(x.shape[-2:])
        x = self._embed(x, grid_size)
        intermediates = []
        if torch.jit.is_scripting() or not stop_early:  # TorchScript cannot slice a ModuleList by a variable
            blocks = self.blocks
        else:
            blocks = self.blocks[: max_index + 1]
        for i, block in enumerate(blocks):
            x = self._join_cls_token(i, x)
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = checkpoint(block, x, grid_size)
            else:
                x = block(x, grid_size)
            if i in take_indices:
                y = self.norm(x) if norm else x
                y = y[:, 1:] if i >= self.local_up_to_layer else y
                intermediates.append(
                    y.reshape(batch, grid_size[0], grid_size[1], -1).permute(0, 3, 1, 2) if output_fmt == "NCHW" else y
                )
        if intermediates_only:
            return intermediates
        return self.norm(x), intermediates

    def prune_intermediate_layers(
        self, indices: int | list[int] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> list[int]:
        """Drop the blocks after the last of `indices` (and the norm / head), for feature extraction."""
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        self.blocks = self.blocks[: max_index + 1]
        if max_index < self.local_up_to_layer:  # the class token would join after the kept blocks
            self.cls_token = None
            self.num_prefix_tokens = 0
            prune_head = prune_head or self.global_pool == "token"
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, "")
        return take_indices

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if self.global_pool == "avg":
            x = x[:, self.num_prefix_tokens :].mean(dim=1)
        elif self.global_pool == "token":
            x = x[:, 0]
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def checkpoint_filter_fn(state_dict: dict[str, torch.Tensor], model: ConViT) -> dict[str, torch.Tensor]:
    """Adapt a timm or official ConViT state dict to `model`: resample `pos_embed` to its token grid.

    The checkpoint's grid is taken as square (all published ConViT weights are)."""
    state_dict = dict(state_dict)
    pos_embed = state_dict.get("pos_embed")
    if pos_embed is not None and model.pos_embed is not None and pos_embed.shape != model.pos_embed.shape:
        side = math.isqrt(pos_embed.shape[1])
        if side * side != pos_embed.shape[1]:
            raise ValueError(
                f"checkpoint pos_embed has {pos_embed.shape[1]} tokens, not a square grid: build the model at the "
                f"checkpoint's img_size and pass a different input size at run time instead"
            )
        state_dict["pos_embed"] = resample_abs_pos_embed(
            pos_embed, new_size=model.patch_embed.grid_size, old_size=(side, side), num_prefix_tokens=0
        )
    return state_dict


def _create_convit(variant: str, pretrained: bool, arch: dict[str, Any], kwargs: dict[str, Any]) -> ConViT:
    """Build `variant` (architecture `arch`, overridable by the user's `kwargs`) through timm's builder.

    timm's builder consumes its own kwargs (features_only, out_indices, feature_cls, pretrained_cfg...);
    what is left goes to `ConViT`, whose TypeError for an unknown kwarg gets the allowed names."""
    kwargs = {**arch, **kwargs}
    feature_cfg = dict(out_indices=kwargs.pop("out_indices", 3), feature_cls="getter")  # as timm's convit
    try:
        return build_model_with_cfg(
            ConViT, variant, pretrained, pretrained_filter_fn=checkpoint_filter_fn, feature_cfg=feature_cfg, **kwargs
        )
    except TypeError as error:
        if "unexpected keyword argument" not in str(error):
            raise
        allowed = ", ".join(sorted(inspect.signature(ConViT).parameters))
        raise TypeError(f"{variant}: {error}; model kwargs: {allowed} (and timm.create_model's own)") from None


def _create_deit_plus(variant: str, pretrained: bool, arch: dict[str, Any], kwargs: dict[str, Any]) -> ConViT:
    """A DeiT+ baseline: the ConViT of its width without GPSA blocks. GPSA blocks asked for (a ConViT recipe's
    `local_up_to_layer`) would make it that ConViT under the DeiT's name, exported and reported as a DeiT:
    refused, naming the ConViT that has them."""
    blocks = kwargs.get("local_up_to_layer", 0)
    if blocks:
        convit = variant.replace("deit_", "convit_")
        raise ValueError(
            f"{variant} has no GPSA blocks: local_up_to_layer={blocks} would make it {convit}; "
            f"give local_up_to_layer=0 for the DeiT, or use {convit}"
        )
    return _create_convit(variant, pretrained, {**arch, "local_up_to_layer": 0}, kwargs)


def _cfg(**kwargs) -> dict[str, Any]:
    return {
        "url": "",
        "num_classes": 1000,
        "input_size": (3, 224, 224),
        "pool_size": None,
        "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD,
        "fixed_input_size": False,  # any multiple of the patch size works (timm's ConVit: True)
        "first_conv": "patch_embed.proj",
        "classifier": "head",
        "license": "apache-2.0",
        **kwargs,
    }


# Same weight sources as timm's convit entries ('timm/' expands to timm/<name>.<tag> on the HF hub).
default_cfgs = generate_default_cfgs(
    {
        "convit_tiny.fb_in1k": _cfg(hf_hub_id="timm/"),
        "convit_small.fb_in1k": _cfg(hf_hub_id="timm/"),
        "convit_base.fb_in1k": _cfg(hf_hub_id="timm/"),
        "convit_tiny_plus": _cfg(),
        "convit_small_plus": _cfg(),
        "convit_base_plus": _cfg(),
        "deit_tiny_plus": _cfg(),
        "deit_small_plus": _cfg(),
        "deit_base_plus": _cfg(),
    }
)


def _register(fn):
    """timm's `register_model`; for timm's own convit_* names it replaces timm's entry (and clears its
    pretrained cfgs) itself, with a warning that is expected here and silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=f"Overwriting {fn.__name__} in registry", category=UserWarning)
        return register_model(fn)


@_register
def convit_tiny(pretrained: bool = False, **kwargs) -> ConViT:
    """ConViT-Ti: 4 heads x 48 (width 192), 10 GPSA + 2 SA blocks."""
    return _create_convit("convit_tiny", pretrained, dict(embed_dim=48, num_heads=4), kwargs)


@_register
def convit_tiny_plus(pretrained: bool = False, **kwargs) -> ConViT:
    """ConViT-Ti+: 4 heads x 64 (width 256)."""
    return _create_convit("convit_tiny_plus", pretrained, dict(embed_dim=64, num_heads=4), kwargs)


@_register
def convit_small(pretrained: bool = False, **kwargs) -> ConViT:
    """ConViT-S: 9 heads x 48 (width 432)."""
    return _create_convit("convit_small", pretrained, dict(embed_dim=48, num_heads=9), kwargs)


@_register
def convit_small_plus(pretrained: bool = False, **kwargs) -> ConViT:
    """ConViT-S+: 9 heads x 64 (width 576)."""
    return _create_convit("convit_small_plus", pretrained, dict(embed_dim=64, num_heads=9), kwargs)


@_register
def convit_base(pretrained: bool = False, **kwargs) -> ConViT:
    """ConViT-B: 16 heads x 48 (width 768)."""
    return _create_convit("convit_base", pretrained, dict(embed_dim=48, num_heads=16), kwargs)


@_register
def convit_base_plus(pretrained: bool = False, **kwargs) -> ConViT:
    """ConViT-B+: 16 heads x 64 (width 1024)."""
    return _create_convit("convit_base_plus", pretrained, dict(embed_dim=64, num_heads=16), kwargs)


@_register
def deit_tiny_plus(pretrained: bool = False, **kwargs) -> ConViT:
    """DeiT-Ti+ baseline: ConViT-Ti+ without GPSA (4 heads x 64, 12 SA blocks)."""
    return _create_deit_plus("deit_tiny_plus", pretrained, dict(embed_dim=64, num_heads=4), kwargs)


@_register
def deit_small_plus(pretrained: bool = False, **kwargs) -> ConViT:
    """DeiT-S+ baseline: 9 heads x 64, 12 SA blocks."""
    return _create_deit_plus("deit_small_plus", pretrained, dict(embed_dim=64, num_heads=9), kwargs)


@_register
def deit_base_plus(pretrained: bool = False, **kwargs) -> ConViT:
    """DeiT-B+ baseline: 16 heads x 64, 12 SA blocks."""
    return _create_deit_plus("deit_base_plus", pretrained, dict(embed_dim=64, num_heads=16), kwargs)
