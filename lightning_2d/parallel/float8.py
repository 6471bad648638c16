"""Float8 training (torchao); async tensor parallelism is ``parallel/async_tensor_parallel.py``.

Float8 training swaps the transformer blocks' ``nn.Linear`` layers for torchao's ``Float8Linear``:
each matmul casts its operands to float8 with dynamic scales (weight and input to e4m3, the
output gradient to e5m2 in the default recipe) and runs on float8 tensor cores, while parameters,
optimizer states and every other op keep their precision. The conversion is a module swap on the
meta-device model, before any parallelism, as torchtitan does it. Under tensor parallelism torchao's
``Float8ColwiseParallel``/``Float8RowwiseParallel``/``PrepareFloat8ModuleInput`` cast the
activations to float8 *before* the sequence-parallel all-gather, so those collectives move half the
bytes of bf16; with FSDP, ``fsdp_float8_all_gather`` does the same for the parameters' all-gather.

Order inside ``parallelize_model``::

    convert_to_float8 → float8_tensor_parallel_plan → TP/SP (+ enable_async_tensor_parallel)
        → activation checkpointing → compile → FSDP2 → materialize
    … and after every optimizer step: precompute_float8_scales(model)

torchao is an optional dependency (``pip install "lightning-2d[float8]"``); it is imported only
when float8 is used.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable, Mapping
from fnmatch import fnmatch
from types import ModuleType
from typing import TYPE_CHECKING

import torch
from torch import nn

from lightning_2d.ops.torchao import quiet_torchao_import, torchao_problem, torchao_version
from lightning_2d.parallel.config import float8_recipe_problems
from lightning_2d.parallel.modules import canonical_name

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

#: NVIDIA GPUs with float8 tensor cores: Ada (8.9) and Hopper (9.0) onwards.
MIN_FLOAT8_CAPABILITY = (8, 9)
FLOAT8_GPUS = "H100, H200, B200, L40S, L4"
#: AMD GPUs with float8 matrix cores (torchao picks the fnuz float8 types on MI300 itself).
FLOAT8_ROCM_ARCHS = ("gfx942", "gfx950")
#: ``torch._scaled_mm`` (the float8 GEMM) needs both weight dimensions to be multiples of 16.
FLOAT8_DIM_MULTIPLE = 16


# ---- what the checks before any process group ask (``parallel/dims.py``: ``float8_device`` …) ---------------
def _torchao_version() -> str | None:
    return torchao_version()


def float8_torchao_problem() -> str | None:
    return torchao_problem("float8=True", "float8", _torchao_version())


def float8_device_problem(device_index: int) -> str | None:
    """Why ``cuda:device_index`` has no float8 tensor cores, or ``None``. Initializes CUDA."""
    props = torch.cuda.get_device_properties(device_index)
    if torch.version.hip:
        arch = getattr(props, "gcnArchName", "")
        if not any(name in arch for name in FLOAT8_ROCM_ARCHS):
            return (
                f"float8=True needs float8 matrix cores (AMD MI300/MI350: {', '.join(FLOAT8_ROCM_ARCHS)});"
                f" cuda:{device_index} is {props.name} ({arch}). Set float8=False."
            )
        return None
    capability = (props.major, props.minor)
    if capability < MIN_FLOAT8_CAPABILITY:
        wanted = ".".join(map(str, MIN_FLOAT8_CAPABILITY))
        return (
            f"float8=True needs float8 tensor cores (CUDA compute capability >= {wanted}: {FLOAT8_GPUS});"
            f" cuda:{device_index} is {props.name} with compute capability {props.major}.{props.minor}."
            " Set float8=False (bf16-mixed is the fast option on this GPU)."
        )
    return None


def float8_off_cuda_problem(device_type: str) -> str:
    """Why (non-emulated) float8 cannot train on ``device_type`` (not CUDA), and what to do."""
    wanted = ".".join(map(str, MIN_FLOAT8_CAPABILITY))
    return (
        f"float8=True runs on GPUs with float8 tensor cores (CUDA compute capability >= {wanted}:"
        f" {FLOAT8_GPUS}), but the accelerator is {device_type!r}. Float8 training is GPU-only: on"
        " CPU torchao can only emulate it (`convert_to_float8(model, emulate=True)`, used by this"
        " library's tests), which is slower than fp32. Set float8=False or train on such GPUs."
    )


# ---- torchao ------------------------------------------------------------------------------------
def _torchao_float8() -> ModuleType:
    """``torchao.float8``, or an ImportError that says how to install it."""
    problem = float8_torchao_problem()
    if problem is not None:
        raise ImportError(problem)
    with quiet_torchao_import():
        import torchao.float8
        import torchao.float8.float8_tensor_parallel  # the TP styles
    return torchao.float8


def _float8_linear_class() -> type[nn.Module] | None:
    # A model can only hold Float8Linear modules if torchao's float8 module was imported, so this
    # lets hooks called on every step stay free when float8 is off.
    module = sys.modules.get("torchao.float8.float8_linear")
    return None if module is None else module.Float8Linear


def _skip_reason(name: str, module: nn.Linear, skip: tuple[str, ...], multiple: int) -> str | None:
    float8_linear = _float8_linear_class()
    if float8_linear is not None and isinstance(module, float8_linear):
        return "is a Float8Linear already"
    if type(module) is not nn.Linear:
        # Float8Linear.from_float builds a plain Float8Linear: a subclass's own forward (like the
        # Llama head's fused loss) would be silently dropped.
        return f"is a {type(module).__name__}, a subclass of nn.Linear whose forward the conversion would drop"
    if any(name == pattern or fnmatch(name, pattern) for pattern in skip):
        return "is named in `skip`"
    if module.in_features % multiple or module.out_features % multiple:
        return (
            f"has in_features={module.in_features}, out_features={module.out_features}; float8 matmuls need"
            f" both to be multiples of {multiple}"
        )
    return None


def convert_to_float8(
    model: nn.Module,
    *,
    skip: Iterable[str] = ("output",),
    emulate: bool = False,
    fsdp_float8_all_gather: bool = False,
    recipe: str = "tensorwise",
    tensor_parallel_size: int = 1,
) -> list[str]:
    """Swap the eligible ``nn.Linear`` layers of ``model`` for torchao's ``Float8Linear``, in place.

    Works on the meta device and keeps each ``weight`` Parameter (the same object, or with
    ``fsdp_float8_all_gather`` a wrapper of it under the same name), so parameter names, seeded
    initialization and checkpoints are unchanged: ``layers.0.attention.wq.weight`` stays.
    Call it before tensor parallelism, activation checkpointing, compile and FSDP.

    A Linear is left in high precision when
    * its name matches an entry of ``skip`` (exact name or ``fnmatch`` pattern such as
      ``layers.0.*``). The default skips the Llama output head: the vocabulary projection is
      the layer most sensitive to float8 rounding, and the Llama head is a ``VocabProjection``
      (below) anyway;
    * it is a subclass of ``nn.Linear`` (the swap would replace its ``forward``);
    * ``in_features`` or ``out_features`` is not a multiple of ``16 × tensor_parallel_size``:
      ``torch._scaled_mm`` needs the dimensions of each rank's weight shard to be multiples of 16
      (and a shape that small would gain nothing from float8 anyway).

    On hardware the token count of each matmul (batch × sequence) must be a multiple of 16 too;
    emulation has no such limit.

    Args:
        model: The model, preferably on the meta device.
        skip: Names or patterns of Linears to keep in high precision.
        emulate: Emulate the float8 matmuls in high precision (rounding included): for CPU tests
            and GPUs without float8 tensor cores. Slower than not converting at all.
        fsdp_float8_all_gather: Make FSDP2 all-gather the weights in float8 (half the bytes of
            bf16). Needs the ``"tensorwise"`` recipe; call ``precompute_float8_scales(model)``
            after each optimizer step.
        recipe: torchao's scaling recipe: ``"tensorwise"`` (one scale per tensor, fastest, the
            only one with float8 all-gathers), ``"rowwise"`` or ``"rowwise_with_gw_hp"`` (a scale
            per row; more accurate).
        tensor_parallel_size: The tensor-parallel size the model will be sharded over.

    Returns:
        The names of the converted Linears.

    Raises:
        ValueError: For an invalid option, or when no Linear can be converted (listing why).
        ImportError: When torchao is missing or too old.
    """
    if isinstance(skip, str):
        raise TypeError(f"skip must be a collection of names, got the string {skip!r}; write skip=({skip!r},)")
    skip = tuple(skip)
    problems = float8_recipe_problems(recipe, fsdp_float8_all_gather, "recipe")
    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        problems.append(f"tensor_parallel_size must be a positive integer, got {tensor_parallel_size!r}")
    if isinstance(model, nn.Linear):
        problems.append(
            f"convert_to_float8 swaps the Linears inside a model in place; got a bare {type(model).__name__}."
            " Wrap it in a module (nn.Sequential(linear))."
        )
    if problems:
        raise ValueError("Cannot convert to float8:\n  - " + "\n  - ".join(problems))

    float8 = _torchao_float8()
    multiple = FLOAT8_DIM_MULTIPLE * tensor_parallel_size
    converted: list[str] = []
    skipped: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        reason = _skip_reason(canonical_name(name), module, skip, multiple)
        if reason is None:
            converted.append(name)
        else:
            skipped.append(f"{name} {reason}")
    if not converted:
        raise ValueError(
            f"float8: no nn.Linear of {type(model).__name__} can be converted"
            f" ({'; '.join(skipped) or 'it has none'}). Set float8=False, or change `skip`/the model's shapes."
        )

    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    config = dataclasses.replace(config, emulate=emulate, enable_fsdp_float8_all_gather=fsdp_float8_all_gather)
    eligible = set(converted)
    float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda _module, fqn: fqn in eligible)
    return [canonical_name(name) for name in converted]


# ---- tensor parallelism -------------------------------------------------------------------------
def float8_tensor_parallel_styles() -> tuple[type[ParallelStyle], type[ParallelStyle], type[ParallelStyle]]:
    """torchao's ``(Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput)``.

    Drop-in replacements of ``ColwiseParallel``/``RowwiseParallel``/``PrepareModuleInput`` for
    ``Float8Linear`` layers converted with the ``"tensorwise"`` recipe: they cast activations to
    float8 before redistributing them. They refuse any module that is not a ``Float8Linear``;
    ``float8_tensor_parallel_plan`` swaps them in only where that holds.
    """
    _torchao_float8()
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


def _matching_modules(model: nn.Module, pattern: str) -> list[nn.Module]:
    # The same matching as parallelize_module: one fnmatch per dotted level.
    found = [model]
    if pattern:
        for token in pattern.split("."):
            found = [child for parent in found for name, child in parent.named_children() if fnmatch(name, token)]
    return found


def _float8_tp_ready(module: nn.Module) -> bool:
    """A ``Float8Linear`` whose every cast is dynamic and tensorwise (what torchao's TP styles assume)."""
    float8_linear = _float8_linear_class()
    if float8_linear is None or not isinstance(module, float8_linear):
        return False
    from torchao.float8.config import ScalingGranularity, ScalingType

    c = module.config
    casts = (
        c.cast_config_input,
        c.cast_config_input_for_grad_weight,
        c.cast_config_weight,
        c.cast_config_weight_for_grad_input,
        c.cast_config_grad_output,
        c.cast_config_grad_output_for_grad_weight,
    )
    return all(
        cast.scaling_type is ScalingType.DYNAMIC and cast.scaling_granularity is ScalingGranularity.TENSORWISE
        for cast in casts
    )


def _inputs_feed_float8_linears(module: nn.Module) -> bool:
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    if not linears or not all(_float8_tp_ready(m) for m in linears):
        return False
    # PrepareFloat8ModuleInput casts once for all of them, with one config.
    return len({m.linear_mm_config for m in linears}) == 1


def float8_tensor_parallel_plan(plan: Mapping[str, ParallelStyle], model: nn.Module) -> dict[str, ParallelStyle]:
    """``plan`` with torchao's float8 styles wherever the modules it names allow them.

    Call it on the converted model (``convert_to_float8``), before ``parallelize_module``. An
    entry whose style is exactly
    * ``ColwiseParallel``/``RowwiseParallel`` and whose every matched module is a tensorwise
      ``Float8Linear`` becomes ``Float8ColwiseParallel``/``Float8RowwiseParallel``;
    * ``PrepareModuleInput`` and whose matched modules contain only tensorwise ``Float8Linear``
      Linears becomes ``PrepareFloat8ModuleInput``: the prepared inputs are cast to float8 once,
      before the all-gather. This assumes, as in Llama's ``attention`` and ``feed_forward``, that
      those inputs feed only the module's Linears.

    Layouts and ``use_local_output`` are kept. Every other entry (embeddings, norms, subclasses
    such as the vocabulary-parallel head, Linears left in high precision, rowwise recipes) is
    returned unchanged, so the plan stays valid for any mix of converted and skipped layers.

    Args:
        plan: Module name pattern → style (``ParallelPlan.tensor_parallel``).
        model: The model the plan applies to, after ``convert_to_float8``.

    Returns:
        A new plan; ``plan`` itself is not modified.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    result: dict[str, ParallelStyle] = dict(plan)
    if _float8_linear_class() is None:  # nothing was converted in this process
        return result
    colwise, rowwise, prepare_input = float8_tensor_parallel_styles()
    for pattern, style in plan.items():
        modules = _matching_modules(model, pattern)
        if not modules:
            continue
        new: ParallelStyle | None = None
        if type(style) in (ColwiseParallel, RowwiseParallel) and all(_float8_tp_ready(m) for m in modules):
            float8_style = colwise if type(style) is ColwiseParallel else rowwise
            new = float8_style(
                input_layouts=style.input_layouts[0],
                output_layouts=style.output_layouts[0],
                use_local_output=style.use_local_output,
            )
        elif type(style) is PrepareModuleInput and all(_inputs_feed_float8_linears(m) for m in modules):
            new = prepare_input(
                input_layouts=style.input_layouts,
                desired_input_layouts=style.desired_input_layouts,
                input_kwarg_layouts=style.input_kwarg_layouts if style.with_kwargs else None,
                desired_input_kwarg_layouts=style.desired_input_kwarg_layouts if style.with_kwargs else None,
                use_local_output=style.use_local_output,
            )
        if new is not None:
            new.src_data_rank = getattr(style, "src_data_rank", 0)
            result[pattern] = new
    return result


# ---- after each optimizer step ------------------------------------------------------------------
def precompute_float8_scales(model: nn.Module) -> None:
    """Compute the float8 scales of FSDP's float8 all-gathers for the next step in one all-reduce.

    With ``fsdp_float8_all_gather`` each weight shard is cast to float8 before FSDP all-gathers
    it, which needs the whole weight's absolute maximum. Called after ``optimizer.step()``, this
    computes all of them at once (one all-reduce) instead of one all-reduce per weight inside the
    next forward. Without the call training stays correct, only slower. A no-op when the model has
    no float8 all-gather weights, so strategies can call it after every step.

    Call it on every rank (it is a collective), after each optimizer step and after loading
    weights into an already trained model (a precomputed scale belongs to the weights it was
    computed from).

    Args:
        model: The parallelized model (FSDP applied).
    """
    float8_linear = _float8_linear_class()
    if float8_linear is None or not any(isinstance(m, float8_linear) for m in model.modules()):
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
