"""The device augmentation's passes (engine.data.augment_passes): each image's drawn ops against rand_augment's
batched ops (timm's, tests/engine/data/test_input_pipeline.py), and the Triton kernels against their reference under
Triton's interpreter. What one batch costs a GPU is tests/benchmarks/test_device_augment_cost.py's.

The interpreter needs TRITON_INTERPRET=1 in the environment before triton is imported: those checks
(tests/support/interpreted_augment.py) run in a child process (`_interpreted_results`), whose measured differences the
tests assert on."""

import numpy as np
import pytest
import torch
from support import REPO
from support.interpreted import interpreted_results

from convbias.engine.data import augment_passes
from convbias.engine.data.device_augment import AugmentSpec, DeviceAugment
from convbias.engine.data.rand_augment import (
    LEVELS,
    OPS,
    OpContext,
    RandAugmentSpec,
    erase,
    erasing_noise,
    layer_plans,
)

pytestmark = pytest.mark.usefixtures("single_thread")

IMAGENET = dict(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
# a warp's pixel off by one level where the kernel's coordinates (fp32, straight from the coefficients) and
# grid_sample's (through affine_grid's [-1, 1]) round a tie the other way; never more than one level
MAX_WARP_LEVELS_OFF, MAX_WARP_PIXELS_OFF = 1, 0.01


def deit_recipe(size: int, **changes) -> AugmentSpec:
    return AugmentSpec(**dict(dict(img_size=size, in_chans=3, **IMAGENET), **changes))


def oracle(images: torch.Tensor, augment: DeviceAugment) -> tuple[torch.Tensor, np.ndarray]:
    """What DeviceAugment should give for its next draw: each image through rand_augment's batched op of each
    layer (timm's ops, tests/engine/data/test_input_pipeline.py) alone, normalized, then its box filled with the noise."""
    n, channels, height, width = images.shape
    spec = augment.rand_augment
    ops, args = spec.sample(n, augment.plan_generator)
    boxes = augment.erasing.sample(n, height, width, augment.plan_generator)
    noise = erasing_noise(augment.erasing.mode, boxes, channels, augment.noise_generator)
    ctx = OpContext(torch.tensor(spec.fill, dtype=torch.float32).view(1, -1, 1, 1), spec.interpolation)
    out = images.float()
    for layer_ops, layer_args in zip(ops, args):
        for i, (k, arg) in enumerate(zip(layer_ops, layer_args)):
            if k >= 0:
                out[i : i + 1] = OPS[spec.names[k]](out[i : i + 1], torch.tensor([arg], dtype=torch.float32), ctx)
    out = out.div_(255.0).sub_(augment.mean).div_(augment.std)
    mode = augment.erasing.mode
    return erase(out, torch.from_numpy(boxes), mode, noise), ops


@pytest.mark.parametrize("auto_augment", ["rand-m9-mstd0.5-inc1", "rand-m7-mstd0.5-n3"])
@pytest.mark.parametrize("re_mode", ["pixel", "rand", "const"])
def test_every_image_gets_its_drawn_ops(auto_augment, re_mode):
    """DeviceAugment (the passes' reference on the CPU) against the oracle, 32 images of 24x20 with every op
    drawn: exact, but for a warp's coefficients, computed in numpy here and in torch there (a level at most)."""
    recipe = deit_recipe(24, auto_augment=auto_augment, re_prob=0.5, re_mode=re_mode)
    images = torch.randint(0, 256, (32, 3, 20, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    augment = DeviceAugment(recipe, "cpu", seed=5)
    state = augment.state_dict()
    drawn = set()
    for _ in range(3):
        got = augment(images)
        augment.load_state_dict(state)
        expected, ops = oracle(images, augment)
        state = augment.state_dict()
        drawn |= set(ops.ravel().tolist())
        levels_off = ((got - expected) * augment.std / (1 / 255)).abs()
        assert levels_off.max() < 1.01, levels_off.max()
        assert (levels_off > 0.01).float().mean() < 0.01
    assert drawn >= set(range(-1, len(augment.rand_augment.names)))


def test_the_ops_build_tables_for_every_point_op():
    """layer_plans' level tables are the point ops' results on the levels 0..255 (the ops that are tested
    against timm's), for every argument the level map gives."""
    spec = RandAugmentSpec.from_timm(
        "rand-m9-mstd0.5", dict(translate_const=10, img_mean=(124, 116, 104), interpolation=3)
    )
    levels = torch.arange(256.0).expand(1, 1, 1, 256)
    for k, name in enumerate(spec.names):
        for magnitude in (0.0, 3.0, 9.0, 10.0):
            arg = LEVELS[name](np.array([magnitude]), np.array([False]), spec.hparams)
            _, tables = layer_plans(spec.names, np.array([[k]]), arg[None], 12, 10)
            if name in ("Invert", "Posterize", "Solarize", "SolarizeAdd"):
                expected = OPS[name](levels, torch.tensor(arg, dtype=torch.float32), None)
                assert np.array_equal(tables[0, 0], expected.flatten().numpy()), (name, magnitude)
            else:
                assert np.array_equal(tables[0, 0], np.arange(256.0)), name


def test_custom_ops_pass_opcheck():
    """Schema and fake (meta) implementations, as torch.compile relies on them."""
    images = torch.randint(0, 256, (4, 3, 6, 5), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    plans, tables = layer_plans(("Invert", "Equalize"), np.array([[0, -1, 1, -1]]), np.zeros((1, 4)), 5, 6)
    torch.library.opcheck(augment_passes.augment_histograms, (images, torch.from_numpy(plans[0])))
    histograms = augment_passes.augment_histograms(images, torch.from_numpy(plans[0]))
    rest = (torch.zeros(4, 5, dtype=torch.float64), torch.zeros(0), torch.zeros(3), torch.zeros(3), torch.ones(3))
    for final in (False, True):
        args = (images, torch.from_numpy(plans[0]), torch.from_numpy(tables[0]), histograms, histograms.cumsum(-1))
        torch.library.opcheck(augment_passes.augment_pass, (*args, *rest, "bilinear", final, "none"))


# -- the Triton kernels under the interpreter (child process) -------------------------------------------------


def _interpreted_results() -> dict:
    return interpreted_results(REPO / "tests" / "support" / "interpreted_augment.py", timeout=600)


@pytest.mark.slow
@pytest.mark.integration
def test_triton_kernels_under_the_interpreter_match_the_reference():
    """RGB bicubic with pixel erasing, RGB bilinear with one color per box, gray bicubic with zeros, and Equalize
    on images large enough for it to change them: histograms equal, every op but the warps exact (uint8 layer
    and normalized output), every erased box exact (a warped image's too), the warps within
    MAX_WARP_LEVELS_OFF levels on at most MAX_WARP_PIXELS_OFF of their pixels."""
    results = _interpreted_results()
    assert results.pop("kernel_runs") == 2 * len(results)
    equalize = results.pop("3 bicubic none, Equalize")
    assert equalize["unchanged_images"] == 0, equalize  # the equalization itself was compared, not a copy
    assert all(got["erased_boxes"] == 2 for got in results.values()), results
    for case, got in {**results, "Equalize": equalize}.items():
        assert got["histograms_equal"] and got["erased_equal"], (case, got)
        assert got["others_max_levels_off"] == 0 and got["others_final_max_off"] == 0, (case, got)
        assert got["warp_max_levels_off"] <= MAX_WARP_LEVELS_OFF, (case, got)
        assert got["warp_pixels_off"] <= MAX_WARP_PIXELS_OFF, (case, got)


def _has_triton_cuda_backend() -> bool:
    try:
        from triton.backends import backends
    except ImportError:
        return False
    return "nvidia" in backends


@pytest.mark.slow
@pytest.mark.skipif(not _has_triton_cuda_backend(), reason="needs triton's CUDA backend (ptxas)")
def test_kernels_compile_for_a_cuda_gpu_without_one():
    """The interpreter checks the kernels' arithmetic, not that Triton's compiler takes them: the last pass
    (bicubic, pixel erasing) and the histograms, compiled to a cubin for sm_90 at the GPU's block size, with no
    fused multiply-add (the blends and fp64 autocontrast round as the reference does)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    from convbias.engine.data import augment_kernels

    pointers = {"images_ptr": "*u8", "plan_ptr": "*fp64", "tables_ptr": "*fp64", "boxes_ptr": "*fp64"}
    pointers |= {"hist_ptr": "*i32", "cumulative_ptr": "*i32"}
    sizes = dict(C=3, CP=4, BLOCK=augment_passes.GPU_BLOCK)
    for kernel, constants in [
        (augment_kernels.pass_kernel, dict(sizes, BICUBIC=True, FINAL=True, ERASE=1)),
        (augment_kernels.histogram_kernel, sizes),
    ]:
        signature = {
            arg: "constexpr" if arg in constants else pointers.get(arg, "*fp32" if arg.endswith("_ptr") else "i32")
            for arg in kernel.arg_names
        }
        target = GPUTarget("cuda", 90, 32)
        compiled = triton.compile(
            ASTSource(kernel, signature, constants), target=target, options={"enable_fp_fusion": False}
        )
        assert compiled.asm["cubin"] and "fma.rn" not in compiled.asm["ptx"], kernel.__name__
