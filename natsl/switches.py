"""Every speed switch of natsl, in one typed place: read from the environment once, overridable in code.

A speed switch picks between implementations of the same math (a fused kernel or its eager twin,
one product or several); each default is the faster setting on the H200 at the 800M recipes, and the
other settings exist for side-by-side measurements and tests. `current()` gives the switches in
force: the environment (`NATSL_*`, one variable per field) read on first use, or what an enclosing
`override(...)` set:

    with switches.override(fused_loss=False, decode_pdl=False):
        ...                                   # tests and benchmarks, instead of setting variables

`as_dict()` is what `natsl.provenance` records with every result (all of them, defaults included).

torch.compile: code that reads a switch inside a compiled region reads an attribute of the frozen
object that `current()` returns (a module global), which dynamo treats as a Python constant and
guards on; an `override` swaps the object, so compiled code recompiles instead of seeing a stale
value. `natsl.fast.gated_delta` reads `state_split` once, when it is imported (its launch tables
are built then).

Not speed switches, read where they are used: `NATSL_BACKEND` (a user's choice of backend, part of
the ops' public contract, natsl.ops), `NATSL_PEAK_FLOPS` (the MFU denominator, not how anything runs;
natsl.training.flops), `NATSL_CHECK_OPS` (a debugging aid that checks every fast kernel call for
non-finite values, natsl.fast.op_check), `NATSL_CACHE_DIR` and `NATSL_DEBUG_DIR` (where files go),
`NATSL_FAULT` (the crash tests' kill hook, natsl.training.faults), `NATSL_GPU_BLOCK_SIZES` (all: the fast
state kernels at routing block sizes not yet checked on a GPU, natsl.block_size). `natsl.provenance` records
the first three and the last where set.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Iterator, Literal, Optional

from natsl.errors import NatslError


def _switch(default, env: str | None, doc: str, choices: tuple | None = None):
    """A field: its default, the environment variable that sets it (None: only `override` does),
    a one-line doc, and the values a string switch takes."""
    return field(default=default, metadata={"env": env, "doc": doc, "choices": choices})


@dataclass(frozen=True)
class Switches:
    # -- training and the layers' full-sequence forward --------------------------------------------
    compile_pointwise: Literal["auto", "1", "0", "all"] = _switch(
        "auto", "NATSL_COMPILE_POINTWISE", "torch.compile the layers' elementwise pieces: auto on CUDA "
        "tensors while autograd records and in decode steps (many-token calls without gradients, a "
        "prefill or an evaluation, run them eagerly and so start without compiling), 1 on CUDA tensors "
        "always, 0 never, all on every device (CPU tests of the compiled forms)", ("auto", "1", "0", "all"))
    pointwise_dynamic: Literal["auto", "1", "0"] = _switch(
        "auto", "NATSL_POINTWISE_DYNAMIC", "torch.compile's dynamic= for those pieces: auto keeps feature dims "
        "static and lets other sizes turn symbolic on change; 1 all symbolic, 0 none", ("auto", "1", "0"))
    fold_clip: Optional[bool] = _switch(
        None, "NATSL_FOLD_CLIP", "clip and finite check inside the fused AdamW step: None on CUDA, "
        "True on any device, False clips before the step")
    concat_linears: Optional[str] = _switch(
        None, "NATSL_CONCAT_LINEARS", "projection groups run as one product over concatenated weights "
        "(comma list of gdn_qkv, gdn_ab, attn_qkv, gate_up, or all, none); None: the defaults of natsl.models.merged")
    joined_conv: bool = _switch(True, "NATSL_JOINED_CONV", "the GDN q, k, v short convs as one fast op over their "
                                "joined product (False: one op per slice)")
    short_conv_backward: Optional[Literal["walk", "two_pass"]] = _switch(
        None, "NATSL_SHORT_CONV_BACKWARD", "the short conv's backward form; None: walk, or two_pass under the "
        "Triton interpreter (much faster there)", ("walk", "two_pass"))
    fused_mix: bool = _switch(True, "NATSL_FUSED_MIX", "the NAtS-L read of its two memories on its Triton "
                              "kernels (fast backend, the paper's layer); False: the compiled formula")
    fused_loss: bool = _switch(True, "NATSL_FUSED_LOSS", "the LM loss's softmax work on a Triton kernel (CUDA); "
                               "False: eager ops")
    state_split: bool = _switch(True, "NATSL_STATE_SPLIT", "the sequential GDN kernels' last round split off "
                                "(read when natsl.fast.gated_delta is imported)")
    train_auto_compile: bool = _switch(True, "NATSL_TRAIN_AUTO_COMPILE", "natsl train compiles small models "
                                       "with CUDA-graphed steps on one GPU when the recipe asks for neither "
                                       "(natsl.training.trainer.auto_compile)")
    # -- inference (prefill and decode from a cache) ------------------------------------------------
    fused_inference: bool = _switch(True, "NATSL_FUSED_INFERENCE", "the cached paths' fused Triton kernels "
                                    "(CUDA with the fast backend)")
    decode_attention: bool = _switch(True, "NATSL_DECODE_ATTENTION", "the split-K decode attention (where the "
                                     "fused inference kernels run)")
    decode_gemv: bool = _switch(True, "NATSL_DECODE_GEMV", "the decode step's matrix-vector products on the "
                                "GEMV kernel (CUDA)")
    decode_pdl: bool = _switch(True, "NATSL_DECODE_PDL", "programmatic dependent launch of the inference "
                               "kernels (CUDA, compute capability 9.0 or newer)")
    prefill_overlap: bool = _switch(True, "NATSL_PREFILL_OVERLAP", "a long prefill runs the GDN branch on a "
                                    "second CUDA stream beside the softmax branch")
    # Checked against its twin under the Triton interpreter and on a GPU (tests/test_gated_linear.py and
    # test_inference.py, -m gpu -k "decode_step or mamba2").
    fused_gla_decode: bool = _switch(True, "NATSL_FUSED_GLA_DECODE", "Mamba2's decode step (and NAtS-L's on a "
                                     "Mamba2 state) on its one fused Triton kernel where the fused inference "
                                     "kernels run; False: its reference twin")
    # Checked against its twin under the Triton interpreter (tests/test_twins.py) and in the models' decode.
    fused_rope: bool = _switch(True, "NATSL_FUSED_ROPE", "a decode token's softmax q/k norms, RoPE and K/V "
                               "write on one fused Triton kernel where the fused inference kernels run; "
                               "False: its reference twin (eager)")
    # Checked against its twin under the Triton interpreter and on an H100 (tests/test_gemv.py,
    # test_inference.py -k "fused_o_norm or fused_add_norm"). Off by default: the output-norm folds make the GDN
    # and Mamba2 decode slower, in the earlier kernel and in its one-pass successor (docs/performance.md,
    # "Decode launches").
    fused_o_norm: bool = _switch(False, "NATSL_FUSED_O_NORM", "a GDN or Mamba2 layer's decode output norm and "
                                 "gate formed inside its output product's GEMV kernel (one kernel fewer a layer "
                                 "and token) where the GEMV kernel runs; False: the norm kernel, then the GEMV")
    # The same tests and measurement.
    fused_add_norm: bool = _switch(True, "NATSL_FUSED_ADD_NORM", "a decode step's residual add and pre-norm "
                                   "formed inside the next GEMV kernel (the MLP's gate/up, attention's q/k/v, "
                                   "a GDN layer's q/k/v/a/b/g, Mamba2's in_proj: one kernel fewer each a layer and "
                                   "token) where the GEMV kernel runs on one row (natsl.ops.gemv.ADD_NORM_FOLD_ROWS); "
                                   "False: the add-norm kernel, then the GEMV")
    # Checked against its twin and the conv kernel under the Triton interpreter and on an H100 (tests/test_gemv.py
    # -k conv_epilogue, test_inference.py -k fused_conv); measured in docs/performance.md.
    fused_conv: bool = _switch(True, "NATSL_FUSED_CONV", "a GDN layer's decode short convs (q, k, v; Mamba2's xBC) run "
                               "in the epilogue of its merged input product's GEMV kernel where that folds the add "
                               "and norm (one kernel fewer a layer and token); False: the conv step kernel")
    # The padding is tested on the CPU, the capture and replay on the GPU (tests/test_prefill_graph.py -m gpu).
    prefill_graphs: bool = _switch(True, "NATSL_PREFILL_GRAPHS", "short prompts (batch 1, empty cache) prefill "
                                   "from CUDA graphs captured per length bucket (natsl.inference.prefill_graph)")
    # -- forced choices for tests and benchmarks (no environment variable) ---------------------------
    force_fused_inference: Optional[bool] = _switch(
        None, None, "True/False forces the fused inference kernels on (wherever Triton runs, the interpreter "
        "included) or off; None: by device, backend and fused_inference")
    force_decode_attention: Optional[bool] = _switch(
        None, None, "the same for the split-K decode attention; None: decode_attention, then as the fused kernels")
    force_decode_gemv: Optional[bool] = _switch(
        None, None, "the same for the GEMV kernel; None: as force_fused_inference where set, else decode_gemv")
    force_decode_pdl: Optional[bool] = _switch(
        None, None, "the same for PDL on CUDA devices; None: decode_pdl on compute capability 9.0 or newer")


FIELDS = {f.name: f for f in dataclasses.fields(Switches)}
_HINTS = typing.get_type_hints(Switches)


def _check(name: str, value, where: str):
    """`value` if it fits switch `name`'s type, else a NatslError naming `where` it came from."""
    f = FIELDS[name]
    choices = f.metadata["choices"]
    hint = _HINTS[name]
    optional = type(None) in typing.get_args(hint)
    if value is None and optional:
        return value
    if choices is not None:
        ok = value in choices
    elif bool in (hint, *typing.get_args(hint)):
        ok = isinstance(value, bool)
    else:
        ok = isinstance(value, str)
    if not ok:
        expect = list(choices) if choices else [True, False] if bool in (hint, *typing.get_args(hint)) else ["a string"]
        expect = ", ".join(map(str, expect + [None] * optional))
        raise NatslError(f"{where}={value!r} is not one of {expect}: see natsl/switches.py")
    return value


def _parse(name: str, text: str):
    """The value of switch `name` for environment text `text` (as natsl has always read them: a
    boolean switch is off for "0" and on otherwise; NATSL_FOLD_CLIP takes only 0, 1 or empty)."""
    f = FIELDS[name]
    env = f.metadata["env"]
    if name == "fold_clip":
        if text not in ("", "0", "1"):
            raise NatslError(f"{env}={text!r} is not 0 or 1: set 1 to clip inside the fused AdamW step, "
                             "0 to clip before it, or unset it (on for CUDA)")
        return None if text == "" else text == "1"
    if _HINTS[name] is bool:
        return text != "0"
    return _check(name, text, env)


def from_environ(environ: typing.Mapping[str, str] | None = None) -> Switches:
    """The switches that `environ` (default os.environ) sets; unset variables keep the defaults."""
    environ = os.environ if environ is None else environ
    values = {name: _parse(name, environ[f.metadata["env"]]) for name, f in FIELDS.items()
              if f.metadata["env"] is not None and f.metadata["env"] in environ}
    return Switches(**values)


_current: Switches | None = None


def current() -> Switches:
    """The switches in force (the environment, read on the first call, or an enclosing override)."""
    global _current
    if _current is None:
        _current = from_environ()
    return _current


@contextlib.contextmanager
def override(**changes) -> Iterator[Switches]:
    """Set switches by field name for the block (nested blocks stack); yields the switches in force."""
    global _current
    for name, value in changes.items():
        if name not in FIELDS:
            raise NatslError(f"no speed switch {name!r}: use one of {', '.join(FIELDS)}")
        _check(name, value, name)
    before = current()
    _current = dataclasses.replace(before, **changes)
    try:
        yield _current
    finally:
        _current = before


def reload() -> Switches:
    """Read the environment again (after a process changed it; subprocesses read it themselves)."""
    global _current
    _current = None
    return current()


def as_dict() -> dict:
    """Every switch by field name, with its value in force (what provenance records)."""
    return dataclasses.asdict(current())



# The NATSL_* variables that are not speed switches (the module's doc says why each lives elsewhere).
OTHER_VARIABLES = {
    "NATSL_BACKEND": "the ops' backend when a call names none: reference, chunked or fast (natsl.ops)",
    "NATSL_PEAK_FLOPS": "the MFU denominator in FLOP/s (natsl.training.flops)",
    "NATSL_CHECK_OPS": "check every fast kernel call for non-finite values (natsl.fast.op_check)",
    "NATSL_GPU_BLOCK_SIZES": "all: the fast state kernels at routing block sizes not yet checked on a GPU "
                             "(natsl.block_size)",
    "NATSL_CACHE_DIR": "the folder of the built-in corpora's tokenized cache (natsl.data.builtin)",
    "NATSL_DEBUG_DIR": "a folder for natsl train's debugging output (natsl.training.trainer)",
    "NATSL_FAULT": "the crash tests' kill hook (natsl.training.faults)",
}


def markdown_table() -> str:
    """Every NATSL_* variable as a Markdown table (variable, switch field, default, what it does): the
    speed switches from their field metadata, then OTHER_VARIABLES. docs/performance.md holds its
    output, which tests/test_kernel_table.py compares.

    Returns:
        The table's text, one row per line.
    """
    lines = ["| variable | switch | default | what it sets |", "|---|---|---|---|"]
    for name, f in FIELDS.items():
        if f.metadata["env"] is not None:
            lines.append(f"| `{f.metadata['env']}` | `{name}` | `{f.default}` | {f.metadata['doc']} |")
    for env, doc in OTHER_VARIABLES.items():
        lines.append(f"| `{env}` | (not a switch) | unset | {doc} |")
    return "\n".join(lines)
