"""What it takes to run Transformer Engine 2.17's own Python on a machine without a GPU.

TE's wheel `transformer-engine==2.17.0` (py3-none-any, about 1 MB) holds all of
`transformer_engine/pytorch`; what it imports from compiled CUDA code, and what it asks of a GPU,
is answered here. `make install` puts that wheel in a folder of its own (`.venv/te-cpu`, or the
folder CORRECTNESS_TE_CPU names), never in site-packages: there a bare `import transformer_engine`
raises RuntimeError (common/__init__.py 215, the meta package's sanity check), which megatron-core's
`except ImportError` guards (fp8_utils.py 26-29, extensions/transformer_engine.py 62-66...) would not
catch; and where it did import, megatron-core would take its TE paths on the Megatron CPU tiers.

TE exists only inside `te_on_cpu()`: entering puts TE's modules (imported once, then kept) and the
stand-ins in sys.modules, and the CUDA answers in torch; leaving takes all of it away again, so
every other import sees no TE, as before. Each shim, with the TE 2.17 lines it answers:
- The compiled extension `transformer_engine_torch` (`StandInExtension`): its 7 enums with their
  2.17 values (common/include/transformer_engine/transformer_engine.h 660-673, fused_attn.h 29-163;
  constants.py 39 and 83 read DType's at import), the 4 functions the unfused attention path calls
  (get_cudnn_version: utils.py 670; get_fused_attn_backend: backend selection, always
  NVTE_No_Backend here; convert_thd_to_bshd, convert_bshd_to_thd), and inert names for the rest,
  which only import. Any of those called raises `NoCompiledTe`: a fused kernel never runs here.
- `load_framework_extension` (common/__init__.py 128, called at pytorch/__init__.py 18): a no-op;
  `NVTE_PROJECT_BUILDING=1` during the import skips the sanity check and every ctypes load
  (common/__init__.py 363-386).
- `triton` and `onnxscript`, where they are not installed (distributed.py 32 -> triton/pad.py,
  export.py 61 -> onnx_extensions.py 26 import them unconditionally; about 1 GB installed): inert
  modules present only during TE's import; no triton kernel or ONNX export runs on this path.
- Five CUDA queries answered as an sm90 device (H100) would: is_available, device_count,
  current_device, get_device_capability, get_device_properties (module/base.py 847 refuses a
  module without CUDA; backend selection reads the compute capability).
- A torch function mode (`CpuAsCuda`) under which a tensor reports `is_cuda` (module/base.py 1479)
  and `device="cuda"` or `.cuda()` means the CPU (softmax.py 27, dot_product_attention.py 486/491,
  backends.py 503 hard-code it); CUDA streams and RNG-state calls are no-ops.
- BF16 GEMMs as cuBLAS computes them (`correctness.cpu_gemm.gemm_as_cublas`: the FP32 product,
  alpha and beta in FP32, rounded once), not torch's CPU BF16 kernels, whose rounding is the host's
  and which run 20-70 x slower on a CPU without BF16 hardware (TE's unfused attention computes its
  logits with baddbmm and its output with bmm, backends.py 503-560).
- `NVTE_MASKED_SOFTMAX_FUSION=0` (softmax.py 160): BF16 softmax stays on TE's torch code instead of
  the fused masked-softmax kernel.

What runs is TE's own Python: backend selection (get_attention_backend), DotProductAttention's
layout handling and its UnfusedDotProductAttention forward and backward. What does not: every
compiled kernel (FusedAttention, FlashAttention, the fused RoPE and softmax kernels, FusedAdam's
multi_tensor_adam). A record made here says the CPU stands in for CUDA (`provenance()`).
"""

import contextlib
import enum
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from correctness.cpu_gemm import gemm_as_cublas
from correctness.emulated_gpu.gpus import MODELS, Emulated
from correctness.emulated_gpu.runtime import DeviceProperties
from correctness.environment import attributes_replaced, environment_set
from correctness.errors import ImplementationUnavailable

TE_VERSION = "2.17.0"
FOLDER_VARIABLE = "CORRECTNESS_TE_CPU"
STANDS_IN_FOR = "sm90"  # the device the CUDA queries describe
CAPABILITY = (9, 0)
CUDNN_VERSION = (9, 10, 2)  # what get_cudnn_version answers: TE's fused-attention gates read it
TE_ENVIRONMENT = {"NVTE_MASKED_SOFTMAX_FUSION": "0"}
# NVTE_TORCH_COMPILE=0 (jit.py 37-44): TE's small fused functions run eagerly, not through
# torch.compile, which on a CPU would need a C++ compiler (none on the unfused attention path).
IMPORT_ENVIRONMENT = {"NVTE_PROJECT_BUILDING": "1", "NVTE_TORCH_COMPILE": "0"}
# Where triton is installed, TE's Triton kernels (and triton's own, where torch._dynamo imports
# triton first here) are defined for Triton's interpreter, the only way a CPU can run one (the
# emulated GPU does: correctness.emulated_gpu.triton_interpreter); the te-cpu tier launches none.
TRITON_ENVIRONMENT = {"TRITON_INTERPRET": "1"}
_TE_PREFIXES = ("transformer_engine", "transformer_engine_torch")
# Imported unconditionally by TE's Python, used by no code on this tier's path: inert during TE's
# import where they are not installed.
STAND_IN_PACKAGES = ("triton", "onnxscript", "onnx")


class NoCompiledTe(RuntimeError):
    """A compiled TE function was called on the CPU: only TE's Python runs here."""


def te_folder() -> Path:
    """Where TE's wheel is installed for this tier: CORRECTNESS_TE_CPU, else <venv>/te-cpu."""
    named = os.environ.get(FOLDER_VARIABLE)
    return Path(named) if named else Path(sys.prefix) / "te-cpu"


def installed_versions() -> list[str]:
    """The Transformer Engine versions whose metadata the tier's folder holds (pip writes one)."""
    return sorted(path.name.removeprefix("transformer_engine-").removesuffix(".dist-info")
                  for path in te_folder().glob("transformer_engine-*.dist-info"))


def missing_reason() -> str | None:
    """Why TE 2.17's Python is not installed for this tier (None: it is)."""
    folder = te_folder()
    if not (folder / "transformer_engine" / "pytorch" / "__init__.py").is_file():
        return (f"Transformer Engine {TE_VERSION}'s Python is not installed for the CPU tier in {folder}"
                f" (make install puts it there; or set {FOLDER_VARIABLE})")
    found = installed_versions()
    if TE_VERSION not in found:
        return (f"{folder} holds {', '.join(found) or 'no versioned'} Transformer Engine; the CPU tier's shim answers"
                f" {TE_VERSION}'s lines")
    return None


def unusable_reason() -> str | None:
    """Why TE 2.17's Python cannot run here (None: it can): not installed for the tier, a
    Transformer Engine of the machine's own beside it, or its import failing with the shim."""
    reason = missing_reason()
    if reason is not None:
        return reason
    if machine_has_own_te():
        return ("this machine has its own Transformer Engine: its TE tiers run it; TE's CPU copy would register TE's"
                " torch ops a second time beside it")
    try:
        with te_on_cpu():
            pass
    except Exception as error:
        return f"Transformer Engine {TE_VERSION}'s Python does not import with the CPU shim: {type(error).__name__}: {error}"
    return None


def machine_has_own_te() -> bool:
    """Whether a Transformer Engine other than this tier's copy is importable (a training image's)."""
    return not _absent("transformer_engine") or ("transformer_engine" in sys.modules and "transformer_engine" not in _loaded)


# --- the compiled extension ------------------------------------------------------------------

class _StandInEnum(enum.IntEnum):
    """pybind11's enums compare with ints and have `.name` and `__members__`, as IntEnum does."""


def _enum(name: str, values: dict[str, int]) -> type:
    return _StandInEnum(name, values)


# Values: TE 2.17's C headers (transformer_engine.h 660-673; fused_attn.h 29-57, 82-101, 106-115,
# 120-133, 144-151, 156-163); members: the pybind11 registrations (util/pybind_helper.h 18-93).
ENUMS = {
    "DType": {"kByte": 0, "kInt32": 2, "kFloat32": 4, "kFloat16": 5, "kBFloat16": 6, "kFloat8E4M3": 7,
              "kFloat8E5M2": 8, "kFloat4E2M1": 10},
    "NVTE_Bias_Type": {"NVTE_NO_BIAS": 0, "NVTE_PRE_SCALE_BIAS": 1, "NVTE_POST_SCALE_BIAS": 2, "NVTE_ALIBI": 3},
    "NVTE_Mask_Type": {"NVTE_NO_MASK": 0, "NVTE_PADDING_MASK": 1, "NVTE_CAUSAL_MASK": 2,
                       "NVTE_PADDING_CAUSAL_MASK": 3, "NVTE_CAUSAL_BOTTOM_RIGHT_MASK": 4,
                       "NVTE_PADDING_CAUSAL_BOTTOM_RIGHT_MASK": 5},
    "NVTE_Softmax_Type": {"NVTE_VANILLA_SOFTMAX": 0, "NVTE_OFF_BY_ONE_SOFTMAX": 1, "NVTE_LEARNABLE_SOFTMAX": 2},
    "NVTE_QKV_Format": {"NVTE_SBHD": 0, "NVTE_BSHD": 1, "NVTE_THD": 2, "NVTE_BSHD_2SBHD": 3, "NVTE_SBHD_2BSHD": 4,
                        "NVTE_THD_2BSHD": 5, "NVTE_THD_2SBHD": 6, "NVTE_BHSD": 7, "NVTE_QKV_Format_NOT_SET": 8},
    "NVTE_QKV_Layout": {name: value for value, name in enumerate((
        "NVTE_SB3HD", "NVTE_SBH3D", "NVTE_SBHD_SB2HD", "NVTE_SBHD_SBH2D", "NVTE_SBHD_SBHD_SBHD", "NVTE_BS3HD",
        "NVTE_BSH3D", "NVTE_BSHD_BS2HD", "NVTE_BSHD_BSH2D", "NVTE_BSHD_BSHD_BSHD", "NVTE_T3HD", "NVTE_TH3D",
        "NVTE_THD_T2HD", "NVTE_THD_TH2D", "NVTE_THD_THD_THD", "NVTE_SBHD_BSHD_BSHD", "NVTE_BSHD_SBHD_SBHD",
        "NVTE_THD_BSHD_BSHD", "NVTE_THD_SBHD_SBHD", "NVTE_Paged_KV_BSHD_BSHD_BSHD", "NVTE_Paged_KV_BSHD_SBHD_SBHD",
        "NVTE_Paged_KV_SBHD_BSHD_BSHD", "NVTE_Paged_KV_SBHD_SBHD_SBHD", "NVTE_Paged_KV_THD_BSHD_BSHD",
        "NVTE_Paged_KV_THD_SBHD_SBHD", "NVTE_BHSD_BHSD_BHSD"))},
    "NVTE_Fused_Attn_Backend": {"NVTE_F16_arbitrary_seqlen": 1, "NVTE_FP8": 2, "NVTE_No_Backend": -1},
}
# Read at import only (constants.py 108-125, router.py 28, ...): pytorch/csrc/common.h 76-97,
# fused_router.h 26-27, transformer_engine.h 1380-1385, comm_gemm_overlap.h 37-48.
IMPORT_ENUMS = {
    "FP8FwdTensors": {name: value for value, name in enumerate((
        "GEMM1_INPUT", "GEMM1_WEIGHT", "GEMM1_OUTPUT", "GEMM2_INPUT", "GEMM2_WEIGHT", "GEMM2_OUTPUT",
        "GEMM3_INPUT", "GEMM3_WEIGHT", "GEMM3_OUTPUT"))},
    "FP8BwdTensors": {name: value for value, name in enumerate((
        "GRAD_OUTPUT1", "GRAD_INPUT1", "GRAD_OUTPUT2", "GRAD_INPUT2", "GRAD_OUTPUT3", "GRAD_INPUT3"))},
    "NVTERoutingMapFormat": {"BYTEMAP": 0, "BITMAP_U8": 1},
    "Float8BlockScaleTensorFormat": {"GEMM_READY": 0, "COMPACT": 1, "INVALID": 2},
    "CommOverlapType": {"RS": 0, "AG": 1},
    "CommOverlapAlgo": {name: value for value, name in enumerate((
        "BULK_OVERLAP_AG", "BULK_OVERLAP_RS", "SPLIT_PIPELINED_AG_P2P", "SPLIT_PIPELINED_RS", "SPLIT_PIPELINED_RS_P2P",
        "ATOMIC_GEMM_RS", "ATOMIC_GEMM_AG_P2P", "ATOMIC_GEMM_RS_P2P", "EXTERNAL_BULK_OVERLAP_AG"))},
}


class _Inert:
    """An import-only name: attribute access, calls as a decorator, subscripts and annotations all
    give inert values, so that a module defining kernels or exporters imports; nothing it stands
    for is ever computed (calling one with data raises where it matters: StandInExtension)."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attribute: str) -> "_Inert":
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return _Inert(f"{self._name}.{attribute}")

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # used as a decorator: @triton.jit
        return _Inert(f"{self._name}(...)")

    def __getitem__(self, key) -> "_Inert":
        return self

    def __or__(self, other) -> "_Inert":
        return self

    __ror__ = __or__

    def __mro_entries__(self, bases):
        return (object,)

    def __repr__(self) -> str:
        return f"<inert stand-in {self._name}>"


class _InertModule(types.ModuleType):
    def __getattr__(self, attribute: str) -> _Inert:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return _Inert(f"{self.__name__}.{attribute}")


class _Compiled(_Inert):
    """A compiled name of the extension: importable, usable as a base class or annotation; a call
    raises NoCompiledTe."""

    def __getattr__(self, attribute: str) -> "_Compiled":
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return _Compiled(f"{self._name}.{attribute}")

    def __call__(self, *args, **kwargs):
        stand_in = COMPILED_STAND_INS.get(self._name.removeprefix("transformer_engine_torch."))
        if stand_in is not None:
            return stand_in(*args, **kwargs)
        raise NoCompiledTe(f"{self._name} is compiled CUDA code, absent on the CPU tier")


# The extension's functions that compute something where a GPU is emulated (name -> stand-in,
# correctness.emulated_gpu.te_kernels installs them for its block); empty on the te-cpu tier, where
# every compiled function raises NoCompiledTe. Consulted at each call, so names TE bound at import
# (`from transformer_engine_torch import ...`) reach them too.
COMPILED_STAND_INS: dict[str, Any] = {}


def _thd_to_bshd(tensor: torch.Tensor, cu_seqlens: torch.Tensor, batch: int, max_seqlen: int) -> torch.Tensor:
    """The compiled convert_thd_to_bshd's result: each sequence's tokens at the front of its row,
    zeros after."""
    out = tensor.new_zeros((batch, max_seqlen, *tensor.shape[1:]))
    bounds = cu_seqlens.tolist()
    for row, (start, end) in enumerate(zip(bounds, bounds[1:])):
        out[row, : end - start] = tensor[start:end]
    return out


def _bshd_to_thd(tensor: torch.Tensor, cu_seqlens: torch.Tensor, total_tokens: int) -> torch.Tensor:
    bounds = cu_seqlens.tolist()
    return torch.cat([tensor[row, : end - start] for row, (start, end) in enumerate(zip(bounds, bounds[1:]))])[:total_tokens]


class _InertPackages(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds every module of the named packages (`triton.language.standard`) as an inert module."""

    def __init__(self, packages: tuple[str, ...]):
        self.packages = packages

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] not in self.packages:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec) -> types.ModuleType:
        module = _InertModule(spec.name, f"stand-in for {spec.name} during TE's import (correctness.te_on_cpu)")
        module.__path__ = []
        module.__version__ = "0.0.0"  # read at import (common/triton/permutation.py 29)
        return module

    def exec_module(self, module) -> None:
        pass


class StandInExtension(_InertModule):
    """`transformer_engine_torch` on a CPU: enums and four functions; every other name is inert at
    import and raises NoCompiledTe when called."""

    def __init__(self):
        super().__init__("transformer_engine_torch", "stand-in for TE 2.17's compiled extension (correctness.te_on_cpu)")
        for name, values in {**ENUMS, **IMPORT_ENUMS}.items():
            setattr(self, name, _enum(name, values))
        self.get_cudnn_version = lambda: CUDNN_VERSION[0] * 10000 + CUDNN_VERSION[1] * 100 + CUDNN_VERSION[2]
        self.convert_thd_to_bshd = _thd_to_bshd
        self.convert_bshd_to_thd = _bshd_to_thd

    def get_fused_attn_backend(self, *args, **kwargs):
        """No fused backend on the CPU tier; the emulated GPU's gate where one is emulated."""
        gate = COMPILED_STAND_INS.get("get_fused_attn_backend")
        return gate(*args, **kwargs) if gate is not None else self.NVTE_Fused_Attn_Backend.NVTE_No_Backend

    def __getattr__(self, attribute: str):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return _Compiled(f"transformer_engine_torch.{attribute}")


# --- the GPU that is not there -----------------------------------------------------------------

_PROPERTIES = DeviceProperties(Emulated(MODELS["H100"], count=1))  # the sm90 device the queries describe
_CUDA_QUERIES = {
    "is_available": lambda: True,
    "device_count": lambda: 1,
    "current_device": lambda: 0,
    "get_device_capability": lambda device=None: CAPABILITY,
    "get_device_properties": lambda device=None: _PROPERTIES,
    # Not queries: what TE does around its kernels, with nothing to do on one CPU.
    "synchronize": lambda device=None: None,
    "empty_cache": lambda: None,
    "is_current_stream_capturing": lambda: False,
    "current_stream": lambda device=None: None,
    "get_rng_state": lambda device="cuda": torch.get_rng_state(),
    "set_rng_state": lambda state, device="cuda": None,
}


def _cpu_device(value: Any) -> Any:
    """A device argument with CUDA meaning the CPU."""
    if isinstance(value, int) and not isinstance(value, bool):
        return torch.device("cpu")
    if isinstance(value, str) and value.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(value, torch.device) and value.type == "cuda":
        return torch.device("cpu")
    return value


class CpuAsCuda(TorchFunctionMode):
    """Tensors report `is_cuda`; `device="cuda"`, `.cuda()` and `.to("cuda")` give CPU tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if getattr(func, "__self__", None) is torch._C.TensorBase.is_cuda:  # the property's getter
            return True
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if func is torch.Tensor.to:
            args = tuple(_cpu_device(arg) for arg in args)
        return func(*args, **kwargs)


# --- entering and leaving --------------------------------------------------------------------

_loaded: dict[str, types.ModuleType] = {}  # TE's modules and the extension stand-in, once imported


def _te_module(name: str) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in _TE_PREFIXES)


def _absent(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def _import_te(folder: Path) -> dict[str, types.ModuleType]:
    """Imports TE from `folder` with the stand-ins; returns its modules (taken out of sys.modules)."""
    # torch asks once, and caches, whether triton is installed (torch.utils._triton 36-43); its
    # compiler stack is imported here, before any stand-in exists, so that it keeps the true answer.
    import torch._dynamo  # noqa: F401
    from torch.utils._triton import has_triton_package

    has_triton_package()
    finder = _InertPackages(tuple(name for name in STAND_IN_PACKAGES if _absent(name)))
    sys.modules["transformer_engine_torch"] = StandInExtension()
    sys.meta_path.insert(0, finder)
    sys.path.insert(0, str(folder))
    try:
        with environment_set(IMPORT_ENVIRONMENT), warnings.catch_warnings():
            # "could not find the shared object file for the Transformer Engine PyTorch extension":
            # true, and what the stand-in is for (transformer_engine/__init__.py 76).
            warnings.filterwarnings("ignore", message="Detected a PyTorch installation", category=RuntimeWarning)
            # TE decorates its dropout helpers with torch.jit.script where NVTE_TORCH_COMPILE=0 (jit.py 42).
            warnings.filterwarnings("ignore", message=".*torch.jit.script.* is deprecated", category=DeprecationWarning)
            common = importlib.import_module("transformer_engine.common")
            common.load_framework_extension = lambda framework: None
            importlib.import_module("transformer_engine.pytorch")
    finally:
        sys.path.remove(str(folder))
        sys.meta_path.remove(finder)
        for name in list(sys.modules):
            if name.partition(".")[0] in finder.packages:
                del sys.modules[name]
    return {name: module for name, module in sys.modules.items() if _te_module(name)}


@contextlib.contextmanager
def te_on_cpu() -> Iterator[types.ModuleType]:
    """TE 2.17's `transformer_engine.pytorch`, usable on CPU tensors inside the block and gone
    from sys.modules after it. ImplementationUnavailable where its wheel is not installed for this tier."""
    with attributes_replaced(torch.cuda, _CUDA_QUERIES), environment_set(TE_ENVIRONMENT), CpuAsCuda(), gemm_as_cublas():
        with te_modules() as te:
            yield te


@contextlib.contextmanager
def te_modules() -> Iterator[types.ModuleType]:
    """TE 2.17's modules (imported once, then kept) in sys.modules inside the block, and gone from
    it after, whatever stands in for CUDA around them (te_on_cpu's blanket, or the emulated GPU of
    correctness.emulated_gpu). ImplementationUnavailable where its wheel is not installed for this tier."""
    reason = missing_reason()
    if reason is not None:
        raise ImplementationUnavailable(reason)
    others = {name: sys.modules.pop(name) for name in list(sys.modules) if _te_module(name)}
    try:
        if not _loaded:
            with environment_set(TRITON_ENVIRONMENT):
                _loaded.update(_import_te(te_folder()))
        sys.modules.update(_loaded)
        yield sys.modules["transformer_engine.pytorch"]
    finally:
        for name in list(sys.modules):
            if _te_module(name):
                _loaded[name] = sys.modules.pop(name)
        sys.modules.update(others)


def provenance() -> dict[str, Any]:
    """What a record made with TE on the CPU says about it."""
    return {
        "transformer_engine": TE_VERSION,
        "transformer_engine_build": "Python only (py3-none-any wheel), on the CPU",
        "stands_in": {
            "transformer_engine_torch": "correctness.te_on_cpu.StandInExtension (enums, 4 functions; no kernels)",
            "cuda": f"the CPU, answering CUDA queries as {STANDS_IN_FOR} (compute capability {CAPABILITY[0]}.{CAPABILITY[1]})",
            "bf16_gemm": "FP32 product rounded once, as cuBLAS (correctness.cpu_gemm), not torch's CPU BF16 kernel",
            "cudnn_version": ".".join(map(str, CUDNN_VERSION)) + " (reported to TE's backend selection; none loaded)",
            **{name: "inert module during TE's import" for name in STAND_IN_PACKAGES if _absent(name)},
        },
        "environment": {**TE_ENVIRONMENT, **IMPORT_ENVIRONMENT},
    }
