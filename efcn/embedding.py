"""Embed a CNN into its equivalent fully connected network (eFCN), Sec. 6.2.1 of the thesis.

A Conv2d acting on a (C_in, H, W) map is a linear map from C_in*H*W to C_out*H'*W' features. Its
matrix is built by index arithmetic (no Python loop over positions): for every output pixel and
filter tap we compute the input pixel it reads, drop the taps that land in the zero padding, and
scatter the filter values into a zero matrix, a few output channels at a time. The peak memory is
the dense matrix plus one bounded chunk.

Every embedded conv keeps its locality mask: entry (out pixel p, in pixel q) is local when q lies
in the receptive field of p. The mask does not depend on the channels, so it is stored once per
layer as a (H'*W', H*W) boolean matrix; `LocalLinear.full_mask()` broadcasts it over channels.

Layers without weights keep their function after reshaping: elementwise ones (ReLU, Dropout, ...)
act on the flat vector directly; spatial ones (pools, zero padding, Dropout2d) run on the
activation viewed back as (C, H, W) (`OnFeatureMap`). BatchNorm (running statistics, i.e. the
CNN's eval-mode function) is folded into the Conv2d or Linear right before it.
"""

import copy
import math
import operator
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
import torch.fx
import torch.nn.functional as F
from einops import repeat
from timm.layers import register_notrace_function
from torch import nn

SUPPORTED_LAYERS = (
    "Conv2d (groups=1, zero padding, any kernel/stride/padding/dilation, with or without bias), "
    "Linear, BatchNorm1d/2d right after a Linear/Conv2d (folded), MaxPool2d, AvgPool2d, "
    "AdaptiveMax/AvgPool2d, ZeroPad2d, Dropout, Dropout2d, Flatten, ReLU and other elementwise "
    "activations"
)
ELEMENTWISE = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.ELU,
    nn.GELU,
    nn.SiLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.Hardtanh,
    nn.Identity,
    nn.Dropout,
    nn.AlphaDropout,
)
SPATIAL = (
    nn.MaxPool2d,
    nn.AvgPool2d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveMaxPool2d,
    nn.ZeroPad2d,
    nn.Dropout2d,
)
# Elements per scatter chunk when filling a dense conv matrix: bounds the temporary memory.
FILL_CHUNK_ELEMENTS = 1 << 22

Keep = Literal["all", "local", "off_local"]


class LocalLinear(nn.Linear):
    """The dense Linear layer of an embedded Conv2d, with its locality mask.

    Rows are ordered (out channel, out pixel), columns (in channel, in pixel), as produced by
    flattening NCHW maps. `locality_mask[p, q]` is True when input pixel q is inside the receptive
    field of output pixel p; `tap_index[p, q]` is the filter tap (ky * kw + kx) that connects them,
    -1 off-local. `keep` selects masked evaluation (Fig. 6.5): all weights, local entries only or
    off-local entries only (biases are always kept).
    """

    def __init__(
        self,
        in_shape: tuple[int, int, int],
        out_shape: tuple[int, int, int],
        locality_mask: torch.Tensor,
        tap_index: torch.Tensor,
        bias: bool = True,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        # Skip nn.Linear.__init__: its kaiming init of a huge matrix would be thrown away.
        nn.Module.__init__(self)
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
        self.in_features = math.prod(in_shape)
        self.out_features = math.prod(out_shape)
        self.weight = nn.Parameter(torch.zeros(self.out_features, self.in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(self.out_features, device=device, dtype=dtype)) if bias else None
        self.register_buffer("locality_mask", locality_mask.to(device), persistent=False)
        self.register_buffer("tap_index", tap_index.to(device), persistent=False)
        self.keep: Keep = "all"

    def weight4d(self) -> torch.Tensor:
        """The weight viewed as (C_out, H'*W', C_in, H*W)."""
        c_out, c_in = self.out_shape[0], self.in_shape[0]
        return self.weight.view(c_out, self.locality_mask.shape[0], c_in, self.locality_mask.shape[1])

    def full_mask(self) -> torch.Tensor:
        """Boolean (out_features, in_features) mask of local entries (materialized)."""
        return repeat(self.locality_mask, "p q -> (o p) (i q)", o=self.out_shape[0], i=self.in_shape[0])

    def local_entries(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(out pixel, in pixel, tap) of every local (p, q) pair, as index vectors."""
        out_pixel, in_pixel = self.locality_mask.nonzero(as_tuple=True)
        return out_pixel, in_pixel, self.tap_index[out_pixel, in_pixel].long()

    def masked_weight_chunks(self, keep: Keep) -> Iterator[tuple[slice, torch.Tensor]]:
        """Yield (row slice, rows of the weight with the other part zeroed), a few out channels at a time."""
        w4 = self.weight4d()
        mask = self.locality_mask if keep == "local" else ~self.locality_mask
        mask = mask[:, None, :].to(w4.dtype)
        rows_per_channel = w4.shape[1]
        step = max(1, FILL_CHUNK_ELEMENTS // w4[0].numel())
        for start in range(0, w4.shape[0], step):
            chunk = w4[start : start + step] * mask
            yield (
                slice(start * rows_per_channel, (start + chunk.shape[0]) * rows_per_channel),
                chunk.reshape(-1, self.in_features),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.keep == "all":
            return F.linear(x, self.weight, self.bias)
        return self._masked_forward(x)

    @torch.jit.unused  # diagnostics only (`masked`, eager models)
    def _masked_forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([x @ w.t() for _, w in self.masked_weight_chunks(self.keep)], dim=-1)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_shape={self.in_shape}, out_shape={self.out_shape}, bias={self.bias is not None}"


class OnFeatureMap(nn.Module):
    """Run a spatial layer (pool, padding, Dropout2d) on a flat activation viewed as (C, H, W)."""

    def __init__(self, layer: nn.Module, in_shape: tuple[int, int, int]):
        super().__init__()
        self.layer = layer
        self.in_shape = tuple(in_shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channels, height, width = self.in_shape  # unpacked: TorchScript has no starred arguments
        return self.layer(x.view(x.shape[0], channels, height, width)).flatten(1)

    def extra_repr(self) -> str:
        return f"in_shape={self.in_shape}"


@register_notrace_function  # FX: a leaf (a Python check on the input's size)
def check_input_shape(x: torch.Tensor, input_shape: tuple[int, int, int]) -> torch.Tensor:
    """`x` unchanged; a ValueError unless each sample has the size of `input_shape` (what the eFCN was built for)."""
    if x[0].numel() != input_shape[0] * input_shape[1] * input_shape[2]:
        raise ValueError("EmbeddedFCN was built for inputs of shape " + str(input_shape) + ", got " + str(x.shape[1:]))
    return x


class EmbeddedFCN(nn.Module):
    """A fully connected network: Flatten, then Linear/LocalLinear layers and weightless layers."""

    def __init__(
        self,
        layers: "OrderedDict[str, nn.Module]",
        input_shape: Sequence[int],
        feature_map: tuple[int, Sequence[int]] | None = None,
    ):
        """feature_map: (how many layers come before the CNN's flatten, the (C, H, W) map it flattened);
        forward_features returns that map (viewed from the flat activation), as the CNN's does."""
        super().__init__()
        self.input_shape = tuple(input_shape)
        self.in_chans = self.input_shape[0]
        self.layers = nn.Sequential(layers)
        names = [name for name, _ in self.layers.named_children()]
        head_name, head = [(n, m) for n, m in self.layers.named_children() if isinstance(m, nn.Linear)][-1]
        self.head_name = head_name
        self.head_index = names.index(head_name)  # the head and what follows it: timm's forward_head
        self.features_end, feature_shape = (
            feature_map if feature_map is not None else (self.head_index, (head.in_features,))
        )
        self.feature_shape = list(feature_shape)
        self.num_classes = head.out_features
        self.num_features = self.feature_shape[0]  # channels of the map, as for the CNN
        self.head_hidden_size = head.in_features
        self.flatten_map = True  # False after reset_classifier(0, ''): forward returns the map

    def local_layers(self) -> dict[str, LocalLinear]:
        return {name: m for name, m in self.layers.named_children() if isinstance(m, LocalLinear)}

    def get_classifier(self) -> nn.Module:
        return getattr(self.layers, self.head_name)

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A new last Linear (in the model's mode), or none for num_classes=0 (timm's contract). Like the CNN
        it embeds, an eFCN flattens its last map: `global_pool` 'flatten' (None: unchanged) keeps that, ''
        with no classifier returns the map, where nothing but the classifier reads the flat vector."""
        if global_pool not in (None, "flatten", ""):
            raise ValueError(
                f"global_pool={global_pool!r}: an eFCN flattens its last map, the only pooling it has; "
                "use None, 'flatten' or '' (no classifier)"
            )
        if global_pool == "" and (num_classes or self.features_end != self.head_index):
            raise ValueError(
                "global_pool='': an eFCN can return its last map only without a classifier "
                "(num_classes=0) and when nothing else reads the flat vector (no MLP after the flatten)"
            )
        reference = next(self.parameters())
        new_head = (
            nn.Linear(self.head_hidden_size, num_classes, device=reference.device, dtype=reference.dtype)
            if num_classes > 0
            else nn.Identity()
        )
        setattr(self.layers, self.head_name, new_head.train(self.training))
        self.num_classes = num_classes
        if global_pool is not None:
            self.flatten_map = global_pool == "flatten"

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The CNN's last map (B, C, H, W) before its flatten, computed by the fully connected layers."""
        x = check_input_shape(x, self.input_shape).flatten(1)
        for index, layer in enumerate(self.layers):  # (loops, not slices: TorchScript calls no slice)
            if index < self.features_end:
                x = layer(x)
        return x.view([x.shape[0]] + self.feature_shape)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if not self.flatten_map:
            return x
        x = x.flatten(1)
        for index, layer in enumerate(self.layers):  # after the flatten: an MLP if any, then the head
            if index >= self.features_end and (index < self.head_index or not pre_logits):
                x = layer(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


@contextmanager
def masked(model: nn.Module, keep: Keep):
    """Evaluate `model` with only the local ("local") or off-local ("off_local") conv weights."""
    if keep not in ("all", "local", "off_local"):
        raise ValueError(f"keep must be 'all', 'local' or 'off_local', got {keep!r}")
    if isinstance(model, torch.jit.ScriptModule):  # its layers are no LocalLinear: it would run unmasked
        raise ValueError("masked needs the eager model: a TorchScript-compiled eFCN evaluates all its weights only")
    layers = [m for m in model.modules() if isinstance(m, LocalLinear)]
    previous = [m.keep for m in layers]
    for m in layers:
        m.keep = keep
    try:
        yield model
    finally:
        for m, k in zip(layers, previous):
            m.keep = k


# ---------------------------------------------------------------------------------------------
# Tracing the CNN into a chain of steps


@dataclass
class _Step:
    name: str
    layer: nn.Module | None  # None for a flatten
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...] = ()
    batchnorm: nn.Module | None = None  # folded into a Conv2d/Linear
    kind: str = ""


def _trace_chain(cnn: nn.Module) -> list[tuple[str, nn.Module | None]]:
    """The CNN's forward as an ordered list of (name, module); None stands for a flatten."""
    try:
        graph = torch.fx.symbolic_trace(cnn).graph
    except Exception as error:  # fx raises many types for untraceable code
        raise ValueError(
            f"embed could not trace {type(cnn).__name__}.forward ({error}); it supports a chain of layers "
            f"(an nn.Sequential, or a forward that applies its layers one after the other)"
        ) from error
    modules = dict(cnn.named_modules())
    chain: list[tuple[str, nn.Module | None]] = []
    current = None
    auxiliary = set()  # x.size(0) / x.shape nodes used by a view
    for node in graph.nodes:
        if node.op == "placeholder":
            if current is not None:
                raise ValueError(f"embed supports a CNN with one input; {type(cnn).__name__} takes several")
            current = node
            continue
        if node.op == "output":
            if node.args[0] is not current:
                raise ValueError(
                    f"embed supports a chain of layers; {type(cnn).__name__}.forward does not "
                    f"return the output of its last layer"
                )
            break
        inputs = node.all_input_nodes
        is_size = (node.op == "call_method" and node.target == "size") or (
            node.op == "call_function"
            and node.target in (getattr, operator.getitem)
            and (node.args[0] is current or node.args[0] in auxiliary)
        )
        if is_size:
            auxiliary.add(node)
            continue
        if not inputs or inputs[0] is not current or any(a not in auxiliary for a in inputs[1:]):
            raise ValueError(
                f"embed supports a chain of layers; node {node.name!r} of {type(cnn).__name__}.forward "
                f"does not take the previous layer's output as its only input"
            )
        if node.op == "call_module":
            chain.append((node.target, modules[node.target]))
        elif _is_flatten(node):
            chain.append((node.name, None))
        elif node.op in ("call_function", "call_method") and node.target in (F.relu, torch.relu, "relu"):
            chain.append((node.name, nn.ReLU()))
        else:
            raise ValueError(
                f"embed does not support operation {node.name!r} ({node.op} {node.target}) in "
                f"{type(cnn).__name__}.forward; supported: {SUPPORTED_LAYERS}"
            )
        current = node
    return chain


def _is_flatten(node: torch.fx.Node) -> bool:
    """flatten(x, 1) / x.flatten(1) / x.view(x.size(0), -1) / x.reshape(B, -1)."""
    if node.target in (torch.flatten, "flatten"):
        start = node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)
        end = node.args[2] if len(node.args) > 2 else node.kwargs.get("end_dim", -1)
        return start == 1 and end == -1
    if node.op == "call_method" and node.target in ("view", "reshape"):
        return len(node.args) == 3 and node.args[2] == -1
    return False


def _conv_output_size(size: int, kernel: int, stride: int, dilation: int, pad_total: int) -> int:
    return (size + pad_total - dilation * (kernel - 1) - 1) // stride + 1


def _conv_padding(conv: nn.Conv2d) -> tuple[tuple[int, int], tuple[int, int]]:
    """(left, total) zero padding along H and W, including padding='same' (asymmetric)."""
    if conv.padding == "valid":
        return (0, 0), (0, 0)
    if conv.padding == "same":
        totals = tuple(d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size))
        return tuple(t // 2 for t in totals), totals
    return tuple(conv.padding), tuple(2 * p for p in conv.padding)


def _check_conv(name: str, conv: nn.Module, in_shape: tuple[int, ...]) -> tuple[int, int, int]:
    kind = type(conv).__name__
    if not isinstance(conv, nn.Conv2d) or type(conv).forward is not nn.Conv2d.forward:
        raise ValueError(f"layer {name!r} ({kind}) is not supported; supported: {SUPPORTED_LAYERS}")
    if conv.groups != 1:
        raise ValueError(
            f"layer {name!r} (Conv2d, groups={conv.groups}) is not supported: only groups=1 "
            f"convolutions can be embedded"
        )
    if conv.padding_mode != "zeros":
        raise ValueError(
            f"layer {name!r} (Conv2d, padding_mode={conv.padding_mode!r}) is not supported: only zero padding"
        )
    if len(in_shape) != 3:
        raise ValueError(
            f"layer {name!r} (Conv2d) needs a (C, H, W) feature map but gets a flat vector of {in_shape[0]} features"
        )
    if in_shape[0] != conv.in_channels:
        raise ValueError(
            f"layer {name!r} (Conv2d) expects {conv.in_channels} input channels, gets "
            f"{in_shape[0]} (input_shape and the CNN do not fit)"
        )
    _, pad_total = _conv_padding(conv)
    out_hw = [
        _conv_output_size(s, k, st, d, p)
        for s, k, st, d, p in zip(in_shape[1:], conv.kernel_size, conv.stride, conv.dilation, pad_total)
    ]
    if min(out_hw) < 1:
        raise ValueError(
            f"layer {name!r} (Conv2d kernel {conv.kernel_size}, dilation {conv.dilation}, "
            f"padding {conv.padding}) does not fit a {in_shape[1]}x{in_shape[2]} feature map "
            f"(input_shape too small for the CNN)"
        )
    return (conv.out_channels, *out_hw)


def _plan(cnn: nn.Module, input_shape: tuple[int, int, int]) -> list[_Step]:
    """Walk the chain, fold BatchNorms, and compute every step's input and output shape."""
    steps: list[_Step] = []
    shape: tuple[int, ...] = tuple(input_shape)
    for name, layer in _trace_chain(cnn):
        step = _Step(name=name.replace(".", "_"), layer=layer, in_shape=shape)
        kind = type(layer).__name__
        if layer is None or isinstance(layer, nn.Flatten):
            if isinstance(layer, nn.Flatten) and (layer.start_dim, layer.end_dim) != (1, -1):
                raise ValueError(
                    f"layer {name!r} (Flatten) must flatten dims 1..-1, got "
                    f"start_dim={layer.start_dim}, end_dim={layer.end_dim}"
                )
            step.kind, step.out_shape = "flatten", (math.prod(shape),)
        elif isinstance(layer, (nn.BatchNorm1d, nn.BatchNorm2d)):
            previous = steps[-1] if steps else None
            wanted = "conv" if isinstance(layer, nn.BatchNorm2d) else "linear"
            if previous is None or previous.kind != wanted or previous.batchnorm is not None:
                raise ValueError(
                    f"layer {name!r} ({kind}) can only be folded right after a "
                    f"{'Conv2d' if wanted == 'conv' else 'Linear'}; supported: {SUPPORTED_LAYERS}"
                )
            if layer.running_mean is None:
                raise ValueError(
                    f"layer {name!r} ({kind}) has no running statistics "
                    f"(track_running_stats=False) and cannot be folded"
                )
            previous.batchnorm = layer
            continue
        elif isinstance(layer, nn.Linear):
            if type(layer).forward is not nn.Linear.forward:
                raise ValueError(f"layer {name!r} ({kind}) is not supported; supported: {SUPPORTED_LAYERS}")
            if len(shape) != 1:
                raise ValueError(
                    f"layer {name!r} (Linear) needs a flat input; add a Flatten before it "
                    f"(it gets a feature map of shape {shape})"
                )
            if shape[0] != layer.in_features:
                raise ValueError(
                    f"layer {name!r} (Linear) expects {layer.in_features} features, gets "
                    f"{shape[0]} from input_shape {tuple(input_shape)} (input_shape and the CNN "
                    f"do not fit)"
                )
            step.kind, step.out_shape = "linear", (layer.out_features,)
        elif isinstance(layer, nn.modules.conv._ConvNd):
            step.kind, step.out_shape = "conv", _check_conv(name, layer, shape)
        elif type(layer) in ELEMENTWISE:
            step.kind, step.out_shape = "elementwise", shape
        elif type(layer) in SPATIAL:
            if len(shape) != 3:
                raise ValueError(f"layer {name!r} ({kind}) needs a (C, H, W) feature map but gets a flat vector")
            if getattr(layer, "return_indices", False):
                raise ValueError(f"layer {name!r} ({kind}, return_indices=True) is not supported")
            try:
                out = layer(torch.empty(1, *shape, device="meta"))
            except RuntimeError as error:
                raise ValueError(
                    f"layer {name!r} ({kind}) does not fit a feature map of shape {shape} "
                    f"({error}); input_shape too small for the CNN"
                ) from error
            step.kind, step.out_shape = "spatial", tuple(out.shape[1:])
        else:
            raise ValueError(f"layer {name!r} ({kind}) is not supported; supported: {SUPPORTED_LAYERS}")
        steps.append(step)
        shape = step.out_shape
    if not steps or steps[-1].kind == "conv" or not any(s.kind == "linear" for s in steps):
        raise ValueError("embed expects a classifier: the CNN must end with Linear layers after a Flatten")
    return steps


def _num_params(steps: list[_Step]) -> int:
    total = 0
    for step in steps:
        if step.kind in ("conv", "linear"):
            n_in, n_out = math.prod(step.in_shape), math.prod(step.out_shape)
            total += n_in * n_out + n_out
    return total


# ---------------------------------------------------------------------------------------------
# Building the dense layers


def conv_locality(
    conv: nn.Conv2d, in_hw: tuple[int, int], out_hw: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Locality mask (H'W', HW) and tap index (H'W', HW; -1 off-local) of a conv, by index arithmetic
    on the CPU, also under a `torch.device` context (timm builds models under `torch.device('meta')`)."""
    with torch.device("cpu"):
        pad_left, _ = _conv_padding(conv)
        per_axis = []
        for size, out, kernel, stride, dilation, pad in zip(
            in_hw, out_hw, conv.kernel_size, conv.stride, conv.dilation, pad_left
        ):
            position = torch.arange(out)[:, None] * stride - pad + torch.arange(kernel)[None, :] * dilation
            per_axis.append((position, (position >= 0) & (position < size)))  # (out, kernel)
        (iy, vy), (ix, vx) = per_axis
        (height, width), (out_h, out_w) = in_hw, out_hw
        kh, kw = conv.kernel_size
        # Broadcast to (out_h, out_w, kh, kw).
        valid = vy[:, None, :, None] & vx[None, :, None, :]
        in_pixel = (iy[:, None, :, None] * width + ix[None, :, None, :]).expand_as(valid)[valid]
        out_pixel = (
            torch.arange(out_h)[:, None, None, None] * out_w + torch.arange(out_w)[None, :, None, None]
        ).expand_as(valid)[valid]
        tap = (torch.arange(kh)[None, None, :, None] * kw + torch.arange(kw)[None, None, None, :]).expand_as(valid)[
            valid
        ]
        mask = torch.zeros(out_h * out_w, height * width, dtype=torch.bool)
        mask[out_pixel, in_pixel] = True
        tap_index = torch.full((out_h * out_w, height * width), -1, dtype=torch.int32)
        tap_index[out_pixel, in_pixel] = tap.to(torch.int32)
        return mask, tap_index


def _folded(
    weight: torch.Tensor, bias: torch.Tensor | None, bn: nn.Module | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weight and bias with an eval-mode BatchNorm that follows them folded in."""
    if bn is None:
        return weight, bias
    scale = bn.running_var.add(bn.eps).rsqrt()
    if bn.weight is not None:
        scale = scale * bn.weight
    shift = -bn.running_mean * scale
    if bias is not None:
        shift = shift + bias * scale
    if bn.bias is not None:
        shift = shift + bn.bias
    return weight * scale.view(-1, *([1] * (weight.dim() - 1))), shift


def _embed_conv(step: _Step, copy_weights: bool) -> LocalLinear:
    conv = step.layer
    mask, tap_index = conv_locality(conv, step.in_shape[1:], step.out_shape[1:])
    has_bias = conv.bias is not None or step.batchnorm is not None
    dense = LocalLinear(
        step.in_shape,
        step.out_shape,
        mask,
        tap_index,
        bias=has_bias,
        device=conv.weight.device,
        dtype=conv.weight.dtype,
    )
    if conv.weight.is_meta:  # a structure-only model (timm builds models on the meta device): no values
        return dense
    if not copy_weights:
        dense.reset_parameters()  # nn.Linear's default init of the full matrix: the standard FCN
        return dense
    with torch.no_grad():
        weight, bias = _folded(conv.weight.detach(), None if conv.bias is None else conv.bias.detach(), step.batchnorm)
        c_out, c_in = weight.shape[:2]
        filters = weight.reshape(c_out, c_in, -1)
        out_pixel, in_pixel, tap = (t.to(weight.device) for t in dense.local_entries())
        w4 = dense.weight4d()
        channels_per_chunk = max(1, FILL_CHUNK_ELEMENTS // max(1, tap.numel() * c_in))
        for start in range(0, c_out, channels_per_chunk):
            stop = min(c_out, start + channels_per_chunk)
            # Advanced indices separated by a slice put the gathered dim first: (N, chunk, C_in).
            w4[start:stop, out_pixel, :, in_pixel] = filters[start:stop, :, tap].permute(2, 0, 1)
        if bias is not None:
            dense.bias.copy_(bias.repeat_interleave(mask.shape[0]))
    return dense


def _embed_linear(step: _Step, copy_weights: bool) -> nn.Linear:
    linear = step.layer
    has_bias = linear.bias is not None or step.batchnorm is not None
    dense = nn.Linear(
        linear.in_features, linear.out_features, bias=has_bias, device=linear.weight.device, dtype=linear.weight.dtype
    )
    if copy_weights:
        with torch.no_grad():
            weight, bias = _folded(
                linear.weight.detach(), None if linear.bias is None else linear.bias.detach(), step.batchnorm
            )
            dense.weight.copy_(weight)
            if bias is not None:
                dense.bias.copy_(bias)
    return dense


def _build(cnn: nn.Module, input_shape: Sequence[int], max_params: int | None, copy_weights: bool) -> EmbeddedFCN:
    input_shape = tuple(input_shape)
    if len(input_shape) != 3 or not all(isinstance(s, int) and s > 0 for s in input_shape):
        raise ValueError(f"input_shape must be (C, H, W) with positive ints, got {input_shape!r}")
    steps = _plan(cnn, input_shape)
    n_params = _num_params(steps)
    if max_params is not None and n_params > max_params:
        largest = max(
            (s for s in steps if s.kind in ("conv", "linear")),
            key=lambda s: math.prod(s.in_shape) * math.prod(s.out_shape),
        )
        raise ValueError(
            f"the eFCN of {type(cnn).__name__} at input_shape {input_shape} has {n_params:,} parameters, more "
            f"than max_params={max_params:,} (largest layer {largest.name!r}: {math.prod(largest.out_shape):,} x "
            f"{math.prod(largest.in_shape):,}); use fewer channels or a smaller input"
        )
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    feature_map = None
    for step in steps:
        if step.kind == "flatten" and feature_map is None:
            feature_map = (len(layers), step.in_shape)  # the eFCN's features: the CNN's map before it
        if step.kind == "conv":
            layers[step.name] = _embed_conv(step, copy_weights)
        elif step.kind == "linear":
            layers[step.name] = _embed_linear(step, copy_weights)
        elif step.kind == "elementwise":
            layers[step.name] = _copy_layer(step.layer)
        elif step.kind == "spatial":
            layers[step.name] = OnFeatureMap(_copy_layer(step.layer), step.in_shape)
        # a flatten is the identity on the eFCN's flat activations
    return EmbeddedFCN(layers, input_shape, feature_map)


def _copy_layer(layer: nn.Module) -> nn.Module:
    """A fresh copy of a weightless layer (so the eFCN shares no module with the CNN)."""
    return copy.deepcopy(layer)


def embed(cnn: nn.Module, input_shape: Sequence[int], max_params: int | None = None) -> EmbeddedFCN:
    """The eFCN of `cnn` for inputs of shape (C, H, W): same function (BatchNorm in eval mode).

    Raises ValueError naming the layer for unsupported layers, an input_shape that does not fit the
    CNN, or an eFCN with more than `max_params` parameters (checked before allocating anything).
    """
    return _build(cnn, input_shape, max_params, copy_weights=True)


def standard_fcn(cnn: nn.Module, input_shape: Sequence[int], max_params: int | None = None) -> EmbeddedFCN:
    """The eFCN architecture of `cnn` with PyTorch's default Linear init (the FCN baseline of Sec. 6.2.2)."""
    return _build(cnn, input_shape, max_params, copy_weights=False)
