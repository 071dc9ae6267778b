"""The state functions of the `kiln_model_abi` table (kiln/runtime/include/kiln_model_abi.h:
state_buffer, share_state, read_state, write_state), printed for both targets' wrappers.

A state weight is a buffer the program updates (a KV cache, a counter: Graph IR inputs of kind
"state"); each instance owns a writable copy. libkiln uses these functions to give the entry
points of one package (one model library each) one copy of every state buffer (share_state),
to reset it (write_state from the package's initial values) and to copy it between handles
(read_state / write_state). The target gives the spelling of the buffer's address and of the
two copies; the rest is printed once here."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.ir import program as P


@dataclass(frozen=True)
class StateSpelling:
    """How a target's instance holds state buffer `k` (C++ expressions over `self`, `k`)."""

    buffer: str        # the buffer's address as void*
    adopt: list[str]   # statements making the instance use `buffer` (void*) for state k
    to_host: list[str]  # statements copying kWeightBytes[k] bytes to `host`; may `return`
    from_host: list[str]  # statements copying kWeightBytes[k] bytes from `host`


CPU = StateSpelling(
    buffer="self->owned[k]",
    adopt=["if (!self->borrowed[k]) std::free(self->owned[k]);",
           "self->owned[k] = buffer;",
           "self->w[k] = buffer;",
           "self->borrowed[k] = true;  // its owner (another entry's instance) frees it"],
    to_host=["std::memcpy(host, self->owned[k], static_cast<size_t>(kWeightBytes[k]));"],
    from_host=["std::memcpy(self->owned[k], host, static_cast<size_t>(kWeightBytes[k]));"],
)

CUDA = StateSpelling(
    buffer="reinterpret_cast<void*>(static_cast<uintptr_t>(self->w[k]))",
    adopt=["self->w[k] = static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(buffer));"],
    to_host=["kc::CtxGuard g(self->ctx);",
             "if (kc::check(e, kc::driver().cuMemcpyDtoHAsync(host, self->w[k], "
             "static_cast<size_t>(kWeightBytes[k]), nullptr), \"reading state\") ||",
             "    kc::check(e, kc::driver().cuStreamSynchronize(nullptr), \"reading state\")) "
             "return 1;"],
    from_host=["kc::CtxGuard g(self->ctx);",
               "if (kc::check(e, kc::driver().cuMemcpyHtoD(self->w[k], host, "
               "static_cast<size_t>(kWeightBytes[k])), \"writing state\")) return 1;"],
)


def state_functions(prog: P.Program, spell: StateSpelling) -> list[str]:
    """The four functions (inside the wrapper's anonymous namespace, after Instance)."""
    n_w = len(prog.weights)
    flags = ", ".join("true" if w.mutable else "false" for w in prog.weights) or "false"
    check = (f"  if (!self || k < 0 || k >= {n_w} || !kIsState[k]) return e.fail(\"weight %lld "
             "is not a state buffer of this model\", static_cast<long long>(k));")
    ind = lambda lines: ["  " + s for s in lines]  # noqa: E731
    return [
        "// state buffers (weights the program updates): libkiln shares them between the",
        "// entry points of one package, resets and copies them (kiln_model_abi.h)",
        f"const bool kIsState[] = {{{flags}}};",
        "",
        "void* state_buffer(void* instance, int64_t k) {",
        "  Instance* self = static_cast<Instance*>(instance);",
        f"  if (!self || k < 0 || k >= {n_w} || !kIsState[k]) return nullptr;",
        f"  return {spell.buffer};",
        "}",
        "",
        "int share_state(void* instance, int64_t k, void* buffer, char* err, size_t errlen) {",
        "  kr::Err e{err, errlen};",
        "  Instance* self = static_cast<Instance*>(instance);",
        check,
        "  if (!buffer) return e.fail(\"share_state: buffer is NULL\");",
        *ind(spell.adopt),
        "  return 0;",
        "}",
        "",
        "int read_state(void* instance, int64_t k, void* host, char* err, size_t errlen) {",
        "  kr::Err e{err, errlen};",
        "  Instance* self = static_cast<Instance*>(instance);",
        check,
        *ind(spell.to_host),
        "  return 0;",
        "}",
        "",
        "int write_state(void* instance, int64_t k, const void* host, char* err, size_t errlen) {",
        "  kr::Err e{err, errlen};",
        "  Instance* self = static_cast<Instance*>(instance);",
        check,
        *ind(spell.from_host),
        "  return 0;",
        "}",
        "",
    ]


#: the table's trailing fields, after create_on_device
TABLE_FIELDS = "state_buffer, share_state, read_state, write_state"
