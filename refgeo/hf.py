r"""Paper B's tokenwise protocol on a Hugging Face ``transformers`` model (see :doc:`/theory/tokenwise`).

.. autosummary::

   find_blocks
   hidden_states
   model_logits
   embedding_readout
   intervene
   tokenwise_protocol

The block list of the model (``transformer.h`` of GPT-2, ``model.layers`` of
Llama-style decoders, ``encoder.layer`` of BERT-style encoders, or any other list of
identical modules, each run once per forward pass, in order: a model that shares its
layers, as ALBERT does, is refused) defines the layers: :math:`h_0` is the input of
block 0 and :math:`h_{l+1}` the output of block ``l``, so that the update of block ``l`` is
:math:`\Delta = h_{l+1} - h_l` and an intervention replaces block ``l``'s output at
chosen (sequence, position) pairs and runs the rest of the model on from there
(forward hooks: position embeddings, attention masks and layer norms stay the
model's own).  Padding (``attention_mask == 0``, left or right) is never a token;
position ids are counted over the tokens (``cumsum(mask) - 1``, plus ``padding_idx + 1``
where the position table has a padding row, as RoBERTa's has) and passed to every
model whose ``forward`` takes ``position_ids``, so that a sequence has the same states
whatever its padding (counted from 2 where the embeddings' ``position_ids`` buffer
starts there, as MRA's does).  Decoder-only and encoder-only models are covered;
encoder-decoder models (their decoder runs on decoder inputs), models that hold states
as (tokens, batch, width), such as XLNet, and those whose blocks do not each run once
on the tokens' states (XLM and FlauBERT, Funnel, RWKV, Reformer, Longformer,
SqueezeBERT, ProphetNet, CPM-Ant, Perceiver) are refused by name, as is padding a
model cannot take: any padding for FNet, which takes no attention mask, and left
padding for the decoders of BART-like families loaded as causal LMs, which count
positions from the first column.  A model that is not padding-invariant itself gives
states that move with the padding as its own outputs do (ConvBERT's convolutions and
the approximate attention of YOSO and Nystromformer see the padded positions: their
own hidden states move by about 9e-4, 2e-2 and 5e-4 under right padding).
The model runs in eval mode (dropout off, so that states, logits and divergences are
functions of the weights), and so does a ``readout=`` that is a ``torch.nn.Module``; every
module's training flag is restored afterwards through ``train()``, also when a call
raises, and, when several threads call into one model at once, when the last call ends
(each call's hooks act on its own forward passes: its thread's, or any thread's while
no other refgeo call holds the model, as for ``torch.nn.DataParallel``'s replicas).
A sequence longer than an absolute position table (``config.max_position_embeddings``
of GPT-2 or BERT) is a ``ValueError`` naming ``input_ids``.

This module imports torch and transformers when one of its functions is called, never
at ``import refgeo``; install them with ``pip install "refgeo[hf]"``.  States leave
torch as NumPy arrays (``.detach().cpu().numpy()``); the decomposition, the
divergences and Spearman are :func:`refgeo.decompose`, :func:`refgeo.output_perturbation`'s
divergences and :func:`refgeo.spearman`, and the table is :func:`refgeo.layer_report`'s.

Example, three lines on a model with a masked-LM or causal-LM head::

    enc = tokenizer(texts, return_tensors="pt", padding=True)
    out = refgeo.hf.tokenwise_protocol(model, enc["input_ids"], enc["attention_mask"],
                                       cls="diagonal", k=32, ridge=1e-3)
    pandas.DataFrame(out.table)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from . import _progress
from ._interop import from_foreign
from .tokenwise import CLASSES, _divergence, _freeze_config, _logits, decompose, layer_report
from ._validate import check_bool, check_choice, check_finite, check_int

__all__ = [
    "HiddenStates",
    "ProtocolResult",
    "embedding_readout",
    "find_blocks",
    "hidden_states",
    "intervene",
    "model_logits",
    "tokenwise_protocol",
]

# attribute paths of the block list in common architectures, tried before the search
_KNOWN_BLOCK_PATHS = (
    "transformer.h", "model.layers", "model.decoder.layers", "gpt_neox.layers", "transformer.layers",
    "transformer.blocks", "bert.encoder.layer", "roberta.encoder.layer", "encoder.layer", "layers", "h",
)
_DTYPES = ("float32", "float64")
_DIVERGENCES = ("kl", "reverse_kl", "js")
_READOUT_POSITIONS = ("self", "sum")


def _torch():
    try:
        import torch
    except ImportError:  # pragma: no cover - exercised only without torch
        raise ImportError(
            "refgeo.hf needs torch and transformers: pip install 'refgeo[hf]' "
            "(or pip install torch transformers)."
        ) from None
    return torch


def _check_model(model):
    torch = _torch()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a transformers model), got {type(model).__name__} instead.")
    return torch


# Modules held in eval mode by running calls: id -> [module, its own training flag before
# the first call, number of calls holding it].  Calls on one model from several threads
# share the entry, so the flag saved is the user's, not an earlier call's eval mode, and
# it comes back only when the last of them ends.
_EVAL_HELD: dict[int, list] = {}
_EVAL_LOCK = threading.Lock()


def _hold_eval(modules) -> None:
    with _EVAL_LOCK:
        for m in modules:
            entry = _EVAL_HELD.get(id(m))
            if entry is None:
                _EVAL_HELD[id(m)] = [m, m.training, 1]
            else:
                entry[2] += 1


def _calls_holding(model) -> int:
    """How many refgeo calls hold ``model`` now (0 outside any).  Under the lock that
    guards the counts: without a global interpreter lock a read beside another call's
    release is not atomic."""
    with _EVAL_LOCK:
        entry = _EVAL_HELD.get(id(model))
        return 0 if entry is None else entry[2]


def _release_eval(modules) -> None:
    with _EVAL_LOCK:
        released = {}
        for m in modules:
            entry = _EVAL_HELD[id(m)]
            entry[2] -= 1
            if entry[2] == 0:
                del _EVAL_HELD[id(m)]
                released[id(m)] = entry[1]
        # Parents first: train(flag) sets a module and its subtree, and each descendant
        # then gets its own flag back.  A module with a descendant still held by another
        # call only gets its flag set, so that call keeps running in eval mode.
        for m in modules:
            if id(m) not in released:
                continue
            flag = released[id(m)]
            if all(id(c) in released for c in m.modules()):
                if m.training != flag or any(c.training != released[id(c)] for c in m.children()):
                    m.train(flag)
            else:
                m.training = flag


def _in_eval_mode(fn):
    """Run ``fn(model, ...)`` with every module of ``model`` (and of a ``readout=`` that is
    a module) in eval mode (dropout off: the states, logits and interventions are
    functions of the weights, and an identity patch reproduces the logits), and give each
    module its own training flag back afterwards, also when ``fn`` raises, through
    ``train()`` (so that an override of it runs), and only when the last call on the
    model ends when several threads use it at once."""

    @functools.wraps(fn)
    def run(model, *args, **kwargs):
        torch = _check_model(model)
        modules = {id(m): m for m in model.modules()}
        readout = kwargs.get("readout")
        if isinstance(readout, torch.nn.Module):
            modules.update((id(m), m) for m in readout.modules())
            # parents before their descendants across both trees (a strict ancestor has
            # the larger subtree): a readout holding the model's ln_f and lm_head came
            # after them and, given its flag back, set theirs to it
            size = {i: sum(1 for _ in m.modules()) for i, m in modules.items()}
            held = sorted(modules.values(), key=lambda m: -size[id(m)])
        else:
            held = list(modules.values())  # pre-order: parents before their children
        _hold_eval(held)
        try:
            # Outside the lock: while this call holds the modules no other call gives
            # them their flags back.  Module.eval() is train(False), so an override runs.
            for m in held:
                if m.training:
                    m.train(False)
            return fn(model, *args, **kwargs)
        finally:
            _release_eval(held)

    return run


def _get_path(model, path):
    """The submodule at the dotted ``path`` (integers index module lists), or None where
    the path leads nowhere: an index past a list's end or into a module that is not a
    list raised the ``IndexError`` or ``TypeError`` of the indexing, naming nothing."""
    obj = model
    for part in path.split("."):
        nxt = getattr(obj, part, None)  # also the entries of a ModuleList or ModuleDict ("0")
        if nxt is None and part.isdigit():
            try:
                nxt = obj[int(part)]  # a plain list or tuple
            except (IndexError, TypeError, KeyError):
                return None
        if nxt is None:
            return None
        obj = nxt
    return obj


# Models whose blocks hold states time-major, (T, B, d): read as (B, T, d) they gave other
# tokens' states, and a patch went to the wrong token, silently (XLNet with B != T; its
# element count matched).
_TIME_MAJOR = ("xlnet", "transfo-xl")
# Model types whose blocks do not each run once on the (B, T, d) states of the input
# tokens, with the reason (found by a sweep of transformers' causal- and masked-LM
# classes; each gave states other than the model's own, or an error about its blocks)
_UNSUPPORTED = {
    # the search took transformer.attentions for the blocks: states 2.3 off the model's
    "xlm": "keeps its layers' attention, feed-forward and norm modules in separate lists "
           "(transformer.attentions, transformer.ffns, ...): no module's input is a block's input",
    "funnel": "pools the tokens between its stages (its blocks sit in one list per stage): its states "
              "are not one per token at every layer",
    "rwkv": "halves its residual stream between blocks in eval mode (config.rescale_every) and ignores "
            "attention_mask",
    "reformer": "carries a reversible pair of streams (twice the width) between its blocks and pads the "
                "tokens to its chunk length inside its forward pass",
    "longformer": "pads the tokens to a multiple of its attention window inside its forward pass",
    "squeezebert": "calls its layers' forward past the module hooks, on (batch, width, tokens) states",
    "prophetnet": "runs n-gram prediction streams beside the tokens",
    "cpmant": "prepends prompt tokens to the input",
    "perceiver": "runs its blocks on latent arrays, not on the tokens",
}
_UNSUPPORTED["flaubert"] = _UNSUPPORTED["xlm"]
# Decoders of encoder-decoder families, loaded as causal LMs: their forward takes no
# position_ids and counts positions from the first column, padding included (left
# padding moved every token: states up to 1.9 off)
_COLUMN_POSITIONS = ("bart", "mbart", "mvp", "plbart", "marian", "pegasus", "blenderbot", "blenderbot-small",
                     "bigbird_pegasus", "whisper", "trocr")
# Models that mix every position and take no attention mask: padding changes every token
_NO_MASK = ("fnet",)


def _check_architecture(model) -> None:
    """``ValueError`` for the models whose block states are not the (B, T, d) states of
    the input tokens: encoder-decoder models (their decoder blocks run on decoder inputs
    made from the ids, without the padding mask), time-major ones and those of
    :data:`_UNSUPPORTED`."""
    config = getattr(model, "config", None)
    name = type(model).__name__
    kind = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False) is True:
        raise ValueError(
            f"model must be a decoder-only or an encoder-only model, got the encoder-decoder {name} instead "
            "(its decoder's states depend on decoder inputs); for the encoder's states use an encoder-only "
            "model with the same weights, e.g. transformers.T5EncoderModel."
        )
    if kind in _TIME_MAJOR:
        raise ValueError(
            f"model must hold its hidden states as (batch, tokens, width), got {name}, whose blocks hold "
            "them as (tokens, batch, width) instead."
        )
    if kind in _UNSUPPORTED:
        raise ValueError(
            f"model must run one block per layer on the (batch, tokens, width) states of its input tokens, "
            f"got {name} instead, which {_UNSUPPORTED[kind]}."
        )


def _check_padding(model, m) -> None:
    """``ValueError`` for padding (the (B, T) boolean token mask ``m``) that the model
    cannot take: any padding where it mixes every position without a mask, left padding
    where its positions count the columns."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    name = type(model).__name__
    if kind in _NO_MASK and not m.all():
        raise ValueError(
            f"attention_mask must mark every position as a token for {name}, which mixes all positions and "
            f"takes no attention mask, got padding in sequence {int(np.nonzero(~m.all(axis=1))[0][0])} instead; "
            "pass sequences of one length."
        )
    if kind in _COLUMN_POSITIONS and "position_ids" not in inspect.signature(model.forward).parameters:
        left = np.nonzero((np.diff(m.astype(np.int8), axis=1) > 0).any(axis=1))[0]
        if left.size:
            raise ValueError(
                f"attention_mask must pad on the right for {name}, whose forward takes no position_ids and "
                f"counts positions from the first column, got left padding in sequence {int(left[0])} instead."
            )


def find_blocks(model: Any, blocks: Any = None, /) -> tuple[str, tuple]:
    r"""The model's list of transformer blocks (the layers of the protocol).

    Parameters
    ----------
    model : torch.nn.Module
        A ``transformers`` model (with or without a head).
    blocks : str or sequence of torch.nn.Module, default=None
        Override: a dotted attribute path (``"transformer.h"``: a
        ``torch.nn.ModuleList``, ``torch.nn.Sequential`` or list of modules) or the
        modules themselves, for models the search gets wrong.

    Returns
    -------
    path : str
        Dotted path of the block list (``"<given>"`` for given modules).
    blocks : tuple of torch.nn.Module
        The blocks in execution order, ``L`` of them.

    Notes
    -----
    Known paths first (GPT-2 ``transformer.h``, Llama-style ``model.layers``, BERT
    ``encoder.layer`` and their head-model variants, also under the model's
    ``base_model_prefix``), then the first ``torch.nn.ModuleList`` of
    ``config.num_hidden_layers`` modules of one class, else the longest such list
    (ties: the first in ``named_modules`` order).  Model types whose blocks do not each
    run once on the tokens' states (XLM, Funnel, RWKV, Reformer, Longformer, ...) are
    refused by name.  Time O(number of modules).

    Examples
    --------
    >>> import transformers, refgeo.hf                  # doctest: +SKIP
    >>> m = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2))  # doctest: +SKIP
    >>> refgeo.hf.find_blocks(m)[0]                     # doctest: +SKIP
    'transformer.h'
    """
    torch = _check_model(model)
    _check_architecture(model)
    if blocks is not None:
        if isinstance(blocks, str):
            found = _get_path(model, blocks)
            # a path to a list of other things ("config.architectures") was returned as
            # blocks, and the first hook failed on a str
            if (not isinstance(found, (torch.nn.ModuleList, torch.nn.Sequential, list, tuple)) or len(found) == 0
                    or not all(isinstance(b, torch.nn.Module) for b in found)):
                raise ValueError(f"blocks must name a non-empty list of modules of the model, {blocks!r} does not.")
            return blocks, tuple(found)
        try:
            mods = tuple(blocks)
        except TypeError:  # not iterable: an int or a float
            raise TypeError("blocks must be a dotted path or a non-empty sequence of torch.nn.Module, got "
                            f"{type(blocks).__name__} instead.") from None
        if not mods or not all(isinstance(b, torch.nn.Module) for b in mods):
            what = "an empty sequence" if not mods else "a sequence holding " + ", ".join(
                sorted({type(b).__name__ for b in mods if not isinstance(b, torch.nn.Module)}))
            raise TypeError(f"blocks must be a dotted path or a non-empty sequence of torch.nn.Module, got {what} instead.")
        owned = {id(m) for m in model.modules()}
        if not all(id(b) in owned for b in mods):
            raise ValueError("blocks must be modules of model.")
        first: dict[int, int] = {}
        for l, b in enumerate(mods):
            if first.setdefault(id(b), l) != l:
                raise ValueError(f"blocks must hold distinct modules, got block {first[id(b)]} again at {l}.")
        return "<given>", mods

    def uniform(mod):
        return isinstance(mod, torch.nn.ModuleList) and len(mod) > 0 and len({type(b) for b in mod}) == 1

    # the known paths, also under the base model's attribute (MobileBERT's is
    # mobilebert.encoder.layer, GIT's git.encoder.layer)
    prefix = getattr(model, "base_model_prefix", "")
    for path in _KNOWN_BLOCK_PATHS:
        for full in (path, f"{prefix}.{path}") if isinstance(prefix, str) and prefix else (path,):
            found = _get_path(model, full)
            if uniform(found):
                return full, tuple(found)
    # the search: a list of config.num_hidden_layers blocks first (outermost), then the
    # longest; a longer list nested in a block (a MobileBERT layer's feed-forward
    # stack, a mixture's experts) was taken for the blocks
    config = getattr(model, "config", None)
    n_layers = next((v for v in (getattr(config, a, None) for a in ("num_hidden_layers", "n_layer", "num_layers"))
                     if isinstance(v, int) and not isinstance(v, bool)), None)
    best = None
    for name, mod in model.named_modules():
        if uniform(mod):
            if len(mod) == n_layers:
                return name, tuple(mod)
            if best is None or len(mod) > len(best[1]):
                best = (name, tuple(mod))
    if best is None:
        raise ValueError(
            f"found no list of transformer blocks in {type(model).__name__}; pass blocks= "
            "(a dotted path such as 'transformer.h', or the modules)."
        )
    return best


# ------------------------------------------------------------------ inputs


def _as_long(torch, x, name, device, allow_bool=False):
    """``x`` as a (B, T) long tensor on ``device``; booleans only where ``allow_bool``
    (an attention mask, not token ids: True and False were read as tokens 1 and 0)."""
    if isinstance(x, torch.Tensor):
        t = x
    else:
        try:
            t = torch.as_tensor(np.asarray(x))
        except Exception:
            raise TypeError(f"{name} must be a 2-D array of integers, got {type(x).__name__} instead.") from None
    if t.dtype.is_floating_point or t.dtype.is_complex or (t.dtype == torch.bool and not allow_bool):
        raise TypeError(f"{name} must hold integers, got dtype {t.dtype} instead.")
    if t.device.type == "meta":
        raise TypeError(f"{name} is a meta tensor (a shape without values), which refgeo cannot run.")
    if t.ndim != 2 or t.shape[0] == 0 or t.shape[1] == 0:
        raise ValueError(f"{name} must be a non-empty 2-D array of shape (B, T), got shape {tuple(t.shape)} instead.")
    if t.dtype == getattr(torch, "uint64", None):
        # the cast to long wraps values from 2**63 on to negative ones (a token id
        # 2**63 + 1 was reported as -9223372036854775807)
        top = int(t.detach().cpu().numpy().max())
        if top > np.iinfo(np.int64).max:
            raise ValueError(f"{name} must hold values below 2**63, got {top} instead.")
    return t.to(device=device, dtype=torch.long)


@dataclasses.dataclass(frozen=True)
class _Batch:
    ids: Any  # (B, T) long tensor on the model's device
    mask: Any  # (B, T) long tensor
    position_ids: Any  # (B, T): positions counted over the tokens, so left padding shifts nothing
    sequence: np.ndarray  # (N,) sequence of each token
    position: np.ndarray  # (N,) position of each token
    starts: np.ndarray  # (B + 1,) first token of each sequence


def _batch(model, input_ids, attention_mask):
    torch = _torch()
    device = _device(model)
    if device.type == "meta":
        raise TypeError(
            f"model has its parameters on the meta device (shapes without values), which refgeo cannot run; "
            "load its weights first (e.g. from_pretrained, or to_empty() and load_state_dict)."
        )
    ids = _as_long(torch, input_ids, "input_ids", device)
    try:  # only for the vocabulary check: some models do not implement it (Canine)
        emb = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    except NotImplementedError:
        emb = None
    n_vocab = getattr(emb, "num_embeddings", None)
    if isinstance(n_vocab, int) and (bool((ids < 0).any()) or bool((ids >= n_vocab).any())):
        raise ValueError(
            f"input_ids must hold token ids in [0, {n_vocab}) (the model's vocabulary), got values in "
            f"[{int(ids.min())}, {int(ids.max())}] instead."
        )
    if attention_mask is None:
        mask = torch.ones_like(ids)
    else:
        mask = _as_long(torch, attention_mask, "attention_mask", device, allow_bool=True)
        if tuple(mask.shape) != tuple(ids.shape):
            raise ValueError(
                f"attention_mask must have the shape of input_ids {tuple(ids.shape)}, got {tuple(mask.shape)} instead."
            )
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("attention_mask must hold only 0 (padding) and 1 (token).")
    m = mask.detach().cpu().numpy().astype(bool)
    seq, pos = np.nonzero(m)
    if seq.size == 0:
        raise ValueError("attention_mask must mark at least one token.")
    _check_padding(model, m)
    starts = np.concatenate([[0], np.cumsum(m.sum(axis=1))])
    position_ids = (torch.cumsum(mask, dim=1) - 1).clamp(min=0) + _position_offset(model)
    return _Batch(ids, mask, position_ids, seq.astype(np.int64), pos.astype(np.int64), starts.astype(np.int64))


def _position_offset(model):
    """The model's first position id: ``padding_idx + 1`` where its position table has
    a padding row (RoBERTa and the models built on it count positions from there; given
    positions from 0 they ran every token at the wrong position, padding or not), else 0.
    The table is recognised by its name and an integer ``padding_idx``, whatever its
    class: I-BERT's is a ``QuantEmbedding``, not a ``torch.nn.Embedding``.  Without
    one, the first entry of the embeddings' own ``position_ids`` buffer, where they
    keep one: MRA, YOSO and Nystromformer count from 2 (``arange + 2``), and ran every
    token two positions early."""
    for name, mod in model.named_modules():
        pad = getattr(mod, "padding_idx", None)
        if name.rpartition(".")[2] == "position_embeddings" and isinstance(pad, int) and not isinstance(pad, bool):
            return pad + 1
    torch = _torch()
    for name, buf in model.named_buffers():
        if (name.endswith("embeddings.position_ids") and buf.numel() > 0
                and not torch.is_floating_point(buf) and not torch.is_complex(buf)):
            return int(buf.reshape(-1)[0])
    return 0


def _weights(model):
    # parameters, then buffers: frozen or quantized wrappers hold their weights as buffers,
    # and a model with neither (a pure function of its input) is allowed
    return itertools.chain(model.parameters(), model.buffers())


def _device(model):
    for p in _weights(model):
        return p.device
    return _torch().device("cpu")


def _model_dtype(model):
    """The dtype of the model's first floating weight, or None for a model without one."""
    for p in _weights(model):
        if p.dtype.is_floating_point:
            return p.dtype
    return None


def _chunks(n_seq, batch_size):
    bs = n_seq if batch_size is None else batch_size
    return [(s, min(s + bs, n_seq)) for s in range(0, n_seq, bs)]


def _output_tensor(out):
    return out if not isinstance(out, (tuple, list)) else out[0]


def _with_output(out, h):
    if isinstance(out, (tuple, list)):
        return type(out)((h, *out[1:])) if isinstance(out, tuple) else [h, *out[1:]]
    return h


def _this_call(hook, model):
    """``hook``, run for this call's forward passes only: those of the calling thread, or
    of any thread while no other refgeo call holds ``model``.  Hooks sit on the model's
    modules, and a call on the same model from another thread ran them too (its logits
    came back patched, 0.47 off, and both calls' blocks counted each other's runs); a
    filter on the thread alone lost the forward passes of a model that runs its modules
    in worker threads (``torch.nn.DataParallel``, an executor).  Two refgeo calls at
    once on such a model remain beyond it."""
    owner = threading.get_ident()

    @functools.wraps(hook)
    def run(*args, **kwargs):
        if threading.get_ident() == owner or _calls_holding(model) <= 1:
            return hook(*args, **kwargs)
        return None

    return run


def _forward(model, batch, s0, s1, need_last, blocks):
    """One forward pass of the sequences ``s0:s1``; ``ValueError`` unless each of
    ``blocks`` ran once, in order (the layers of the protocol)."""
    ran: list[int] = []
    counters = [b.register_forward_pre_hook(_this_call(lambda mod, args, _l=l: ran.append(_l), model))
                for l, b in enumerate(blocks)]
    try:
        out = _run(model, batch, s0, s1, need_last)
    finally:
        for h in counters:
            h.remove()
    if ran != list(range(len(blocks))):
        many = [l for l in range(len(blocks)) if ran.count(l) > 1]
        if many:
            what = (f"block {many[0]} ran {ran.count(many[0])} times in one forward pass (a model that "
                    "applies one module several times, as ALBERT shares its layers, has no list of "
                    "blocks that each run once)")
        elif len(set(ran)) < len(blocks):
            what = f"block {min(set(range(len(blocks))) - set(ran))} did not run in the forward pass"
        else:
            what = f"the blocks ran in the order {ran}"
        raise ValueError(
            f"blocks must be modules that each run once per forward pass, in order (h_l is the input of "
            f"block l), but {what}; pass blocks= with such modules.")
    return out


def _run(model, batch, s0, s1, need_last):
    ids, mask = batch.ids[s0:s1], batch.mask[s0:s1]
    kwargs = {"input_ids": ids, "attention_mask": mask}
    params = inspect.signature(model.forward).parameters
    if "position_ids" in params:
        kwargs["position_ids"] = batch.position_ids[s0:s1]
    if "use_cache" in params:
        kwargs["use_cache"] = False
    if need_last:
        kwargs["output_hidden_states"] = True
    kwargs["return_dict"] = True
    try:
        return model(**kwargs)
    except (IndexError, RuntimeError) as exc:
        # Absolute position embeddings (GPT-2, BERT) index a table of
        # config.max_position_embeddings rows: a longer sequence fails deep inside torch
        # ("index out of range in self").  Rotary models run on, so the length is judged
        # only once the forward pass has failed, and only an indexing error is taken for
        # it (another failure of a long input, out of memory, say, was reported as the
        # length).
        if not (isinstance(exc, IndexError) or any(w in str(exc) for w in ("out of range", "out of bounds"))):
            raise
        limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        n = int(mask.sum(dim=1).max()) if "position_ids" in kwargs else int(ids.shape[1])
        if isinstance(limit, int):
            # positions from padding_idx + 1 where the table has a padding row (RoBERTa)
            first = _position_offset(model)
            if n > limit - first:
                why = "" if not first else f" less the first position id, {first}"
                raise ValueError(
                    f"input_ids must have at most {limit - first} tokens per sequence (the model's "
                    f"config.max_position_embeddings{why}), got {n} instead."
                ) from exc
        raise


def _last_hidden(out):
    h = getattr(out, "last_hidden_state", None)
    if h is None:
        hs = getattr(out, "hidden_states", None)
        if hs is None:
            raise ValueError("the model's output has neither last_hidden_state nor hidden_states; pass readout=None.")
        h = hs[-1]
    return h


def _readout_logits(model, out, readout, index=None):
    """Logits from a forward output: the model's head, or ``readout(last hidden states)``."""
    if readout is None:
        z = getattr(out, "logits", None)
        if z is None:
            raise ValueError(
                f"{type(model).__name__} has no LM head (its output has no logits); pass readout=, "
                "e.g. refgeo.hf.embedding_readout(model)."
            )
        if z.ndim != 3:
            # a sequence classifier's (B, labels): indexed [sequence, position], the
            # position read a label and the softmax ran across sequences, silently
            raise ValueError(
                f"{type(model).__name__}'s logits must be one vector per token, of shape (batch, tokens, V), "
                f"got shape {tuple(z.shape)} instead; pass readout=, e.g. refgeo.hf.embedding_readout(model)."
            )
        return z if index is None else z[index]
    h = _last_hidden(out)
    return _apply_readout(readout, h if index is None else h[index])


def _apply_readout(readout, h):
    z = readout(h)
    # logits over a vocabulary per state; anything else would be read as one silently
    if not isinstance(z, _torch().Tensor) or z.ndim != h.ndim or tuple(z.shape[:-1]) != tuple(h.shape[:-1]):
        got = f"shape {tuple(z.shape)}" if hasattr(z, "shape") else type(z).__name__
        raise ValueError(
            f"readout must map hidden states of shape (..., d) = {tuple(h.shape)} to a tensor of logits "
            f"(..., V), got {got} instead."
        )
    return z


def _to_numpy(t):
    # NumPy has no bfloat16: float32 holds every bfloat16 value exactly
    t = t.detach()
    if t.dtype == _torch().bfloat16:
        t = t.float()
    return t.cpu().numpy()


# ------------------------------------------------------------------ hidden states


@dataclasses.dataclass(frozen=True)
class HiddenStates:
    r"""Hidden states :math:`h_0 \dots h_L` of the non-padding tokens of a batch.

    Attributes
    ----------
    states : dict of int to ndarray of shape (N, d)
        ``states[l]`` is :math:`h_l` (``l = 0``: the input of block 0; ``l >= 1``:
        the output of block ``l - 1``), for the kept layers; rows in token order.
    sequence, position : ndarray of int64, shape (N,)
        The (sequence, position) of each token in the batch (row-major over the
        non-padding entries of the attention mask).
    n_blocks : int
        ``L``, the number of blocks.
    blocks : str
        Dotted path of the block list (see :func:`find_blocks`).
    """

    states: dict
    sequence: Any
    position: Any
    n_blocks: int
    blocks: str


def _capture(model, batch, blocks, keep, np_dtype, batch_size, bar=None):
    """Fill one preallocated (N, d) array per kept layer, chunk by chunk of sequences."""
    torch = _torch()
    n = batch.sequence.shape[0]
    out = {}
    T = batch.ids.shape[1]
    hooks = []
    cur = {}

    def store(layer, h):
        if not (isinstance(h, torch.Tensor) and h.is_floating_point() and h.ndim >= 2 and h.shape[-1] > 0
                and h.numel() // h.shape[-1] == (cur["chunk"][1] - cur["chunk"][0]) * T):
            # e.g. blocks=[the token embedding]: its input is the ids (an IndexError
            # naming nothing, or ids read as states)
            got = f"{type(h).__name__}" + (f" of dtype {h.dtype} and shape {tuple(h.shape)}"
                                           if isinstance(h, torch.Tensor) else "")
            where = "the input of block 0" if layer == 0 else f"the output of block {layer - 1}"
            if (isinstance(h, torch.Tensor) and h.is_floating_point() and h.ndim == 3
                    and h.shape[0] == cur["chunk"][1] - cur["chunk"][0] and h.shape[1] != T):
                # the blocks are right, the length is not: BigBird's block-sparse
                # attention pads the ids to a multiple of config.block_size inside;
                # Canine downsamples its characters (no state per token to take)
                if h.shape[1] < T:
                    raise ValueError(
                        f"the model shortened the sequence: {where} has {h.shape[1]} positions where "
                        f"input_ids has {T} (Canine downsamples its characters), so its blocks hold no "
                        "state per token, which refgeo needs; such models are not supported.")
                raise ValueError(
                    f"the model changed the sequence length: {where} has {h.shape[1]} positions where "
                    f"input_ids has {T} (BigBird's block-sparse attention pads to a multiple of "
                    f"config.block_size); pad input_ids to such a length yourself, with attention_mask 0 "
                    f"on the padding, or use a configuration that keeps the length.")
            raise ValueError(
                f"blocks must be transformer blocks, whose input and output are hidden states of shape "
                f"(B, T, d), but {where} is a {got}; pass blocks= with such modules.")
        s0, s1 = cur["chunk"]
        r0, r1 = batch.starts[s0], batch.starts[s1]
        flat = torch.as_tensor((batch.sequence[r0:r1] - s0) * T + batch.position[r0:r1], device=h.device)
        g = h.detach().reshape(-1, h.shape[-1]).index_select(0, flat)  # the one gathered copy
        if layer not in out:
            out[layer] = np.empty((n, h.shape[-1]), dtype=np_dtype)
        out[layer][r0:r1] = _to_numpy(g)

    try:
        if 0 in keep:
            def pre(mod, args, kwargs):
                store(0, args[0] if args else kwargs["hidden_states"])
            hooks.append(blocks[0].register_forward_pre_hook(_this_call(pre, model), with_kwargs=True))
        for l in range(len(blocks)):
            if l + 1 in keep:
                def post(mod, args, output, _l=l + 1):
                    store(_l, _output_tensor(output))
                hooks.append(blocks[l].register_forward_hook(_this_call(post, model)))
        with torch.no_grad():
            for s0, s1 in _chunks(batch.ids.shape[0], batch_size):
                cur["chunk"] = (s0, s1)
                _forward(model, batch, s0, s1, False, blocks)
                if bar is not None:
                    bar.advance()
    finally:
        for h in hooks:
            h.remove()
    return out


def _check_layers(layers, n_states, name):
    if layers is None:
        return tuple(range(n_states))
    if isinstance(layers, np.ndarray) and layers.ndim == 0:
        layers = layers[()]  # its scalar (it failed as "iteration over a 0-d array")
    if isinstance(layers, (int, np.integer)):
        layers = (layers,)
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
        raise TypeError(f"{name} must be None, an int or a sequence of ints, got {type(layers).__name__} instead.")
    out = tuple(check_int(v, f"{name}[{i}]", min_value=0, max_value=n_states - 1) for i, v in enumerate(layers))
    if not out or len(set(out)) != len(out):
        raise ValueError(f"{name} must be non-empty and hold no repeats, got {list(layers)} instead.")
    return out


@_in_eval_mode
def hidden_states(
    model: Any,
    input_ids: Any,
    attention_mask: Any = None,
    /,
    *,
    layers: Any = None,
    dtype: str = "float32",
    blocks: Any = None,
    batch_size: int | None = None,
) -> HiddenStates:
    r"""Hidden states :math:`h_0 \dots h_L` of every (or chosen) layer, padding excluded.

    Parameters
    ----------
    model : torch.nn.Module
        A ``transformers`` model.  It runs in eval mode (dropout off), and every
        module's training flag is restored afterwards, also on errors.
    input_ids : array_like or torch.Tensor of int, shape (B, T)
    attention_mask : array_like or torch.Tensor of {0, 1}, shape (B, T), default=None
        ``0`` marks padding (left or right); None means no padding.
    layers : int or sequence of int, default=None
        Which of :math:`h_0 \dots h_L` to keep (None: all ``L + 1``).
    dtype : {"float32", "float64"}, default="float32"
        dtype of the returned arrays.
    blocks : str or sequence of modules, default=None
        Override of :func:`find_blocks`.
    batch_size : int, default=None
        Sequences per forward pass (None: all at once).

    Returns
    -------
    HiddenStates

    Notes
    -----
    Forward hooks on the blocks: a pre-hook on block 0 records :math:`h_0`, a hook on
    block ``l`` records :math:`h_{l+1}` (before any final norm the model applies
    after its last block).  Memory: one (N, d) array per kept layer, ``(L+1) N d``
    entries for all layers (e.g. 7 x 3000 x 384 float32 = 32 MB for MiniLM), plus
    one transient gathered (n_chunk, d) copy per layer and chunk; the model's own
    activations for one chunk.  Time: one forward pass per chunk.

    Examples
    --------
    >>> import transformers, refgeo.hf                                    # doctest: +SKIP
    >>> m = transformers.GPT2Model(transformers.GPT2Config(n_layer=2, n_embd=8, n_head=2)).eval()  # doctest: +SKIP
    >>> hs = refgeo.hf.hidden_states(m, [[1, 2, 3], [4, 5, 0]], [[1, 1, 1], [1, 1, 0]])  # doctest: +SKIP
    >>> sorted(hs.states), hs.states[2].shape, hs.sequence.tolist()      # doctest: +SKIP
    ([0, 1, 2], (5, 8), [0, 0, 0, 1, 1])
    """
    _check_model(model)
    path, blks = find_blocks(model, blocks)
    check_choice(dtype, "dtype", _DTYPES)
    if batch_size is not None:
        batch_size = check_int(batch_size, "batch_size", min_value=1)
    keep = _check_layers(layers, len(blks) + 1, "layers")
    batch = _batch(model, input_ids, attention_mask)
    states = _capture(model, batch, blks, set(keep), np.dtype(dtype), batch_size)
    return HiddenStates(
        states={l: states[l] for l in sorted(keep)}, sequence=batch.sequence, position=batch.position,
        n_blocks=len(blks), blocks=path,
    )


# ------------------------------------------------------------------ interventions


def _patch_hook(model, block, patch):
    """Hook replacing block output entries ``[seq, pos]`` by ``values`` (a clone, then writes)."""

    def hook(mod, args, output):
        if patch.get("seq") is None:
            return None
        h = _output_tensor(output)
        d = patch["values"].shape[-1]
        if not (isinstance(h, _torch().Tensor) and h.is_floating_point() and h.ndim == 3 and h.shape[-1] == d):
            # e.g. blocks=[lm_head]: torch's shape-mismatch RuntimeError from the write
            got = f"{type(h).__name__}" + (f" of dtype {h.dtype} and shape {tuple(h.shape)}"
                                           if isinstance(h, _torch().Tensor) else "")
            raise ValueError(
                f"blocks must be transformer blocks, whose output is hidden states of shape (B, T, d) "
                f"with d = {d} (the patched states' width), but the patched block's output is a {got}; "
                "pass blocks= with such modules.")
        h = h.clone()
        h[patch["seq"], patch["pos"]] = patch["values"].to(dtype=h.dtype, device=h.device)
        return _with_output(output, h)

    return block.register_forward_hook(_this_call(hook, model))


@_in_eval_mode
def model_logits(
    model: Any,
    input_ids: Any,
    attention_mask: Any = None,
    /,
    *,
    layer: int | None = None,
    sequence: Any = (),
    position: Any = (),
    states: Any = None,
    readout: Callable | None = None,
    blocks: Any = None,
) -> np.ndarray:
    r"""Logits of the model, optionally with block ``layer``'s output replaced at (sequence, position) pairs.

    Parameters
    ----------
    model, input_ids, attention_mask, blocks
        As in :func:`hidden_states`.
    layer : int, default=None
        Block ``l`` (``0 <= l < L``) whose output :math:`h_{l+1}` is patched; None runs
        the model unchanged (and then ``sequence``, ``position`` and ``states`` must be
        left out: a ``ValueError`` otherwise).
    sequence, position : array_like of int, shape (n,)
        Where to patch (unique pairs, non-padding); float indices are a ``TypeError``.
    states : array_like or tensor of shape (n, d)
        The patched states (cast to the model's dtype); a tensor is read as its values
        (autograd history ignored, bfloat16 exactly).
    readout : callable, default=None
        None: the model's own LM head (``...ForCausalLM``, ``...ForMaskedLM``,
        ``GPT2LMHeadModel``); else a callable from last hidden states (a torch tensor
        of shape (..., d)) to logits (..., V), e.g. :func:`embedding_readout`.

    Returns
    -------
    logits : ndarray of shape (B, T, V)
        In the model's dtype (the readout's with ``readout``), bfloat16 as float32
        (NumPy has no bfloat16; the values are exact); padding positions included, as
        the model returns them.

    Notes
    -----
    One forward pass with a forward hook on block ``l`` that returns a copy of its
    output with the given entries replaced; everything after (attention of later
    positions, residual stream, final norm, head) is the model's own computation.
    Patching with the original states reproduces the unpatched logits bit for bit.
    """
    torch = _check_model(model)
    _, blks = find_blocks(model, blocks)
    batch = _batch(model, input_ids, attention_mask)
    _check_readout(readout)
    patch: dict[Any, Any] = {}
    hook = None
    if layer is None and (states is not None or _n_given(sequence) or _n_given(position)):
        raise ValueError("layer must name the block to patch when sequence, position or states are given, got None.")
    if layer is not None:
        layer = check_int(layer, "layer", min_value=0, max_value=len(blks) - 1)
        seq = _index_array(sequence, "sequence")
        pos = _index_array(position, "position")
        vals = None if states is None else _host_states(states, "states")
        if seq.shape != pos.shape or vals is None or vals.ndim != 2 or vals.shape[0] != seq.shape[0]:
            raise ValueError("sequence, position and states must have matching lengths n ((n,), (n,), (n, d)).")
        if seq.size:
            vals = _check_states(vals, seq.size, _d_model(model, batch, blks), "states", model)
            T = batch.ids.shape[1]
            if seq.min() < 0 or seq.max() >= batch.ids.shape[0] or pos.min() < 0 or pos.max() >= T:
                raise ValueError("sequence and position must index entries of input_ids.")
            # a repeated pair would be written twice in an unspecified order
            if np.unique(seq * T + pos).size != seq.size:
                raise ValueError("sequence and position must hold unique (sequence, position) pairs.")
            if not bool(batch.mask[torch.as_tensor(seq), torch.as_tensor(pos)].cpu().bool().all()):
                raise ValueError("sequence and position must name tokens, not padding (attention_mask == 0).")
        if seq.size:
            patch.update(seq=torch.as_tensor(seq), pos=torch.as_tensor(pos), values=torch.as_tensor(vals))
        hook = _patch_hook(model, blks[layer], patch)
    try:
        with torch.no_grad():
            out = _forward(model, batch, 0, batch.ids.shape[0], readout is not None, blks)
            return _to_numpy(_readout_logits(model, out, readout))
    finally:
        if hook is not None:
            hook.remove()


def _n_given(x) -> int:
    """Entries of an index argument (0 for the default ``()``)."""
    return int(np.size(x)) if x is not None else 0


def _index_array(x, name):
    """1-D int64 indices; floats (which NumPy would truncate) and booleans are a ``TypeError``."""
    if isinstance(x, _torch().Tensor):
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integer indices, got dtype {a.dtype} instead.")
    return a.astype(np.int64).reshape(-1)


def _check_readout(readout):
    if readout is not None and not callable(readout):
        raise TypeError(f"readout must be None or a callable, got {type(readout).__name__} instead.")


def embedding_readout(model: Any, /) -> Callable:
    r"""Logit-lens readout through the tied input embeddings: :math:`z = h E^T`.

    For checkpoints without an LM head (a sentence encoder such as MiniLM): the
    vocabulary logits of the last hidden states through the word-embedding matrix
    :math:`E` (V, d) of ``model.get_input_embeddings()``.

    Parameters
    ----------
    model : torch.nn.Module

    Returns
    -------
    readout : callable
        ``readout(h)`` maps a tensor (..., d) to logits (..., V) in the model's dtype.
    """
    _check_model(model)
    if not callable(getattr(model, "get_input_embeddings", None)):
        raise TypeError(
            "model must be a Hugging Face model with get_input_embeddings(), got "
            f"{type(model).__name__} instead."
        )
    emb = model.get_input_embeddings()
    if emb is None or not hasattr(emb, "weight"):
        raise ValueError(f"{type(model).__name__} has no input embedding matrix.")
    W = emb.weight

    def readout(h):
        return h @ W.T

    readout.__name__ = "embedding_readout"
    return readout


def _check_probe(probe, n, seed):
    seed = check_int(seed, "seed", min_value=0)
    if probe is None:
        return np.arange(n, dtype=np.int64)
    if isinstance(probe, (int, np.integer)) and not isinstance(probe, bool):
        # at most n: a larger m was clamped to n silently
        m = check_int(probe, "probe", min_value=1, max_value=n)
        return np.sort(np.random.default_rng(seed).choice(n, size=m, replace=False)).astype(np.int64)
    p = np.asarray(probe)
    if p.dtype.kind not in "iu" and (p.size or p.ndim == 0):
        raise TypeError(
            "probe must be None, a number of tokens, or a 1-D array of integer token indices, got "
            f"{type(probe).__name__} of dtype {p.dtype} instead."
        )
    if p.ndim != 1 or p.size == 0:
        raise ValueError(
            "probe must be None, a number of tokens, or a non-empty 1-D array of token indices, got shape "
            f"{p.shape} instead."
        )
    if p.min() < 0 or p.max() >= n or np.unique(p).size != p.size:
        raise ValueError(f"probe must hold unique token indices in [0, {n}).")
    return np.sort(p.astype(np.int64))


def _passes(batch, probe, batch_size):
    """The forward passes of the interventions: per chunk, one original and one per probed position."""
    plan = []
    for s0, s1 in _chunks(batch.ids.shape[0], batch_size):
        r0, r1 = batch.starts[s0], batch.starts[s1]
        toks = probe[(probe >= r0) & (probe < r1)]
        if toks.size:
            pos = batch.position[toks]
            plan.append((s0, s1, toks, [(t, toks[pos == t]) for t in np.unique(pos)]))
    return plan


def _intervene(model, batch, blks, layer, P, probe, divergence, readout_position, readout, batch_size, bar):
    torch = _torch()
    n = batch.sequence.shape[0]
    div = np.full(n, np.nan)
    patch = {}
    hook = _patch_hook(model, blks[layer], patch)
    Pt = torch.as_tensor(P)
    try:
        with torch.no_grad():
            for s0, s1, _, groups in _passes(batch, probe, batch_size):
                mask = batch.mask[s0:s1]
                patch.clear()
                out = _forward(model, batch, s0, s1, readout is not None, blks)
                if readout_position == "sum":
                    z_all, lp_all = _logits(_to_numpy(_readout_logits(model, out, readout)), "the model's logits")
                    valid = _to_numpy(mask).astype(bool)
                elif readout is None:
                    # a model without an LM head: the ValueError naming readout, as in
                    # model_logits (was an AttributeError on out.logits)
                    z_orig = _readout_logits(model, out, None)
                else:
                    h_orig = _last_hidden(out)
                del out
                bar.advance()
                for t, toks in groups:
                    s_loc = torch.as_tensor(batch.sequence[toks] - s0)
                    patch.update(seq=s_loc, pos=int(t), values=Pt[torch.as_tensor(toks)])
                    # the whole chunk runs again, so the batch (and its rounding) is the original one
                    out = _forward(model, batch, s0, s1, readout is not None, blks)
                    if readout_position == "self":
                        if readout is None:
                            zp, zq = z_orig[s_loc, t], _readout_logits(model, out, None)[s_loc, t]
                        else:
                            zp = _apply_readout(readout, h_orig[s_loc, t])
                            zq = _apply_readout(readout, _last_hidden(out)[s_loc, t])
                        div[toks] = _divergence(_logits(_to_numpy(zp), "the model's logits"),
                                                _logits(_to_numpy(zq), "the model's logits"), divergence)
                    else:
                        sl = s_loc.numpy()
                        Q = _logits(_to_numpy(_readout_logits(model, out, readout, s_loc)), "the model's logits")
                        dv = _divergence((z_all[sl], lp_all[sl]), Q, divergence)
                        div[toks] = np.sum(np.where(valid[sl], dv, 0.0), axis=-1)
                    del out
                    bar.advance()
    finally:
        hook.remove()
    return div


def _host_states(P, name):
    """States as a NumPy array: tensors (with autograd history, bfloat16, on a device) as
    their host values; integer, boolean and complex values are a ``TypeError``."""
    P, _ = from_foreign(P, name, host=True)
    P = np.asarray(P)
    if P.dtype.kind != "f":
        raise TypeError(f"{name} must hold real floating-point values, got dtype {P.dtype} instead.")
    return P


def _check_states(P, n, d, name, model):
    P = _host_states(P, name)
    if P.ndim != 2 or P.shape != (n, d):
        raise ValueError(f"{name} must be a float array of shape ({n}, {d}), got shape {P.shape} instead.")
    check_finite(P, name)
    # written into the model's own dtype: a float32 model turned states of 1e39 into inf,
    # and then NaN logits (or an error blaming the model's logits)
    import torch

    dtype = _model_dtype(model)
    top = float(np.max(np.abs(P))) if P.size else 0.0
    if dtype is not None and top > torch.finfo(dtype).max:
        raise ValueError(
            f"{name} must be within the range of the model's dtype {str(dtype).replace('torch.', '')} "
            f"(largest finite {torch.finfo(dtype).max:.4g}), got an entry of magnitude {top:.4g} instead."
        )
    return P


@_in_eval_mode
def intervene(
    model: Any,
    input_ids: Any,
    attention_mask: Any = None,
    /,
    *,
    layer: int,
    states: Any,
    probe: Any = None,
    seed: int = 0,
    divergence: str = "kl",
    readout_position: str = "self",
    readout: Callable | None = None,
    blocks: Any = None,
    batch_size: int | None = None,
    progress: Any = False,
) -> np.ndarray:
    r"""Per-token output divergence when block ``layer``'s output at one token is replaced.

    For each probed token i at (s, t), block ``l``'s output :math:`h_{l+1}` at (s, t)
    alone is replaced by ``states[i]`` and the model runs on; the divergence of the
    output distribution from the unpatched one is recorded.

    Parameters
    ----------
    model, input_ids, attention_mask, blocks, batch_size
        As in :func:`hidden_states`.
    layer : int
        Block ``l``, ``0 <= l < L``.
    states : array_like or tensor of shape (N, d)
        Replacement states for every token of the batch (token order of
        :func:`hidden_states`), e.g. ``result.patched(h_l)`` of
        :func:`refgeo.decompose`; only the probed rows are used.
    probe : None, int or array_like of int, default=None
        The tokens to intervene on: all (None), ``m <= N`` tokens drawn uniformly
        without replacement with ``seed``, or the given token indices.
    seed : int, default=0
        Seed of the draw of ``m`` probed tokens (unused otherwise).
    divergence : {"kl", "reverse_kl", "js"}, default="kl"
        As in :func:`refgeo.output_perturbation` (p the original, q the patched output).
    readout_position : {"self", "sum"}, default="self"
        The divergence at the patched position, or summed over the non-padding
        positions of its sequence.
    readout : callable, default=None
        As in :func:`model_logits`.
    progress : bool or callable, default=False
        One step per forward pass.

    Returns
    -------
    div : ndarray of float64, shape (N,)
        ``>= 0`` at the probed tokens, NaN elsewhere.

    Notes
    -----
    Batched as :func:`refgeo.output_perturbation` with ``mode="per_token"``: position
    t of every sequence of a chunk is patched in one forward pass, and every pass
    runs the whole chunk, so that an identity patch reproduces the original logits
    bit for bit (KL exactly 0).  Cost: per chunk of sequences, 1 + (number of
    probed positions) forward passes; memory: the model's activations for one chunk
    plus its logits, (B, T, V) in the model's dtype for the model's head and
    float64 log-probabilities (B, T, V) with ``readout_position="sum"``.
    """
    _check_model(model)
    _, blks = find_blocks(model, blocks)
    layer = check_int(layer, "layer", min_value=0, max_value=len(blks) - 1)
    check_choice(divergence, "divergence", _DIVERGENCES)
    check_choice(readout_position, "readout_position", _READOUT_POSITIONS)
    if batch_size is not None:
        batch_size = check_int(batch_size, "batch_size", min_value=1)
    _check_readout(readout)
    progress = _progress.check_progress(progress)
    batch = _batch(model, input_ids, attention_mask)
    n = batch.sequence.shape[0]
    d = _d_model(model, batch, blks)
    P = _check_states(states, n, d, "states", model)
    probe = _check_probe(probe, n, seed)
    plan = _passes(batch, probe, batch_size)
    total = sum(1 + len(g) for *_, g in plan)
    with _progress.Progress(progress, total, desc="intervene", unit="pass") as bar:
        return _intervene(model, batch, blks, layer, P, probe, divergence, readout_position, readout, batch_size, bar)


def _d_model(model, batch, blks):
    cfg = getattr(model, "config", None)
    for name in ("hidden_size", "n_embd", "d_model"):
        v = getattr(cfg, name, None)
        if isinstance(v, int):
            return v
    # the first token and its own sequence (sequence 0 may be all padding: its row of
    # ids was run with the first token's index, an IndexError)
    s = int(batch.sequence[0])
    one = _Batch(batch.ids[s:s + 1], batch.mask[s:s + 1], batch.position_ids[s:s + 1], np.zeros(1, dtype=np.int64),
                 batch.position[:1], np.array([0, 1]))
    h = _capture(model, one, blks, {0}, np.float32, None)
    return h[0].shape[1]


# ------------------------------------------------------------------ the protocol


@dataclasses.dataclass(frozen=True)
class ProtocolResult:
    r"""Paper B's protocol on a model: one decomposition and one set of interventions per layer.

    Attributes
    ----------
    table : list of dict
        :func:`refgeo.layer_report`'s rows, one per layer (``layer`` is the block
        index ``l`` of the update :math:`h_l \to h_{l+1}`), with the divergences as
        perturbations: ``spearman_error_perturbation`` is Spearman(error, divergence)
        over the probed tokens, ``mean_perturbation`` their mean divergence.
    results : tuple of TokenwiseResult
        The decompositions (empty with ``keep_results=False``).
    divergences : tuple of ndarray of shape (N,)
        Per-token divergence per layer (NaN outside the probe).
    sequence, position : ndarray of int64, shape (N,)
        (sequence, position) of each token.
    probe : ndarray of int64
        The probed token indices.
    config : dict
        Every choice: the model, the block list, the layers, the decomposition's
        options (``decompose`` = the first result's ``config``), the probe, the
        divergence, the readout, the batching and the memory mode.
    """

    table: list
    results: tuple
    divergences: tuple
    sequence: Any
    position: Any
    probe: Any
    config: dict

    def __post_init__(self):
        _freeze_config(self)


@_in_eval_mode
def tokenwise_protocol(
    model: Any,
    input_ids: Any,
    attention_mask: Any = None,
    /,
    *,
    layers: Any = None,
    cls: str,
    k: int | None = None,
    ridge: float = 0.0,
    prior: str = "identity",
    exclude_self: bool = True,
    decompose_options: Mapping[str, Any] | None = None,
    probe: Any = None,
    seed: int = 0,
    divergence: str = "kl",
    readout_position: str = "self",
    readout: Callable | None = None,
    dtype: str = "float32",
    keep_layers: str = "all",
    keep_results: bool = True,
    blocks: Any = None,
    batch_size: int | None = None,
    progress: Any = False,
) -> ProtocolResult:
    r"""Paper B's protocol for chosen layers: decomposition, per-token interventions, Spearman, one table.

    For each block ``l`` in ``layers``: :func:`refgeo.decompose` of
    :math:`(h_l, h_{l+1})`, then, for each probed token, block ``l``'s output at that
    token alone replaced by its tokenwise prediction :math:`A_i h_{l,i}`
    (``result.patched``) and the output divergence recorded (:func:`intervene`); the
    table is :func:`refgeo.layer_report` with these divergences.

    Parameters
    ----------
    model, input_ids, attention_mask, blocks, batch_size
        As in :func:`hidden_states`.
    layers : int or sequence of int, default=None
        Blocks ``l`` (``0 <= l < L``) to analyze; None means all.
    cls, k, ridge, prior, exclude_self
        As in :func:`refgeo.decompose` (paper B: ``cls="diagonal"``, ``k=32``,
        ``ridge=1e-3``, ``prior="identity"``, ``exclude_self=True``).
    decompose_options : mapping, default=None
        Further keywords of :func:`refgeo.decompose` (``rank``, ``metric``,
        ``standardize``, ``weights``, ``subspace_rank``, ``center_subspace``,
        ``baselines``, ``mlp_options``, ``chunk_size``).
    probe, seed, divergence, readout_position, readout
        As in :func:`intervene`.
    dtype : {"float32", "float64"}, default="float32"
        dtype of the hidden states handed to the decomposition (which computes in
        float64 either way).
    keep_layers : {"all", "pair"}, default="all"
        ``"all"``: one capture of every needed layer up front; ``"pair"``: only
        :math:`h_l` and :math:`h_{l+1}` of the layer in progress are held (one extra
        forward pass per chunk and layer).
    keep_results : bool, default=True
        Keep every layer's :class:`~refgeo.TokenwiseResult` (three (N, d) float64
        arrays each) in the result.
    progress : bool or callable, default=False
        Steps: the capture passes, one per decomposition, one per intervention pass.

    Returns
    -------
    ProtocolResult

    Notes
    -----
    Memory, for N tokens, ``L'`` analyzed layers and width d: the hidden states,
    ``(L' + 1) N d`` entries of ``dtype`` with ``keep_layers="all"`` (all ``L + 1``
    for consecutive layers) or ``2 N d`` with ``"pair"``; the decomposition's peak
    (about eight N x d float64 arrays, :func:`refgeo.decompose`); ``3 N d`` float64
    per kept result; the interventions' chunk activations and logits (see
    :func:`intervene`).  Time: per layer, the decomposition plus
    ``n_chunks + (probed positions per chunk)`` forward passes.

    Examples
    --------
    >>> import transformers, refgeo.hf                                   # doctest: +SKIP
    >>> cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50)  # doctest: +SKIP
    >>> m = transformers.GPT2LMHeadModel(cfg).eval()                     # doctest: +SKIP
    >>> ids = np.random.default_rng(0).integers(0, 50, size=(4, 12))     # doctest: +SKIP
    >>> out = refgeo.hf.tokenwise_protocol(m, ids, cls="diagonal", k=8, ridge=1e-3)  # doctest: +SKIP
    >>> [row["layer"] for row in out.table]                              # doctest: +SKIP
    [0, 1]
    """
    torch = _check_model(model)
    path, blks = find_blocks(model, blocks)
    L = len(blks)
    chosen = _check_layers(layers, L, "layers")
    # the decomposition's own choices, before the capture passes (minutes on a large model)
    check_choice(cls, "cls", CLASSES + ("mlp",))
    k = check_int(k, "k", min_value=1, allow_none=True)
    check_choice(divergence, "divergence", _DIVERGENCES)
    check_choice(readout_position, "readout_position", _READOUT_POSITIONS)
    check_choice(dtype, "dtype", _DTYPES)
    check_choice(keep_layers, "keep_layers", ("all", "pair"))
    keep_results = check_bool(keep_results, "keep_results")
    if batch_size is not None:
        batch_size = check_int(batch_size, "batch_size", min_value=1)
    _check_readout(readout)
    if decompose_options is not None and not isinstance(decompose_options, Mapping):
        raise TypeError(
            f"decompose_options must be a mapping of keywords of refgeo.decompose, got "
            f"{type(decompose_options).__name__} instead."
        )
    opts = dict(decompose_options or {})
    clash = sorted(set(opts) & {"k", "cls", "ridge", "prior", "exclude_self", "layer", "progress"})
    if clash:
        raise TypeError(f"decompose_options must not repeat the protocol's own keywords, got {clash}.")
    # before the capture passes (minutes on a large model), as cls and k are: the names
    # here, their values by decompose on the first layer's states
    # keywords only: X and Y are positional-only (they passed here, and decompose
    # refused them after the capture)
    keywords = {n for n, q in inspect.signature(decompose).parameters.items()
                if q.kind in (q.KEYWORD_ONLY, q.POSITIONAL_OR_KEYWORD)}
    unknown = sorted(set(opts) - keywords)
    if unknown:
        raise TypeError(f"decompose_options must hold keywords of refgeo.decompose, got unknown {unknown}.")
    progress = _progress.check_progress(progress)
    batch = _batch(model, input_ids, attention_mask)
    n = batch.sequence.shape[0]
    seed = check_int(seed, "seed", min_value=0)  # recorded in the config as a Python int
    probe_idx = _check_probe(probe, n, seed)
    plan = _passes(batch, probe_idx, batch_size)
    if readout is None:
        # the interventions read the model's logits: a model without an LM head (MiniLM
        # as AutoModel, readout= forgotten) is refused before the capture passes and the
        # first decomposition (minutes on a real model), from one sequence's forward pass
        with torch.no_grad():
            _readout_logits(model, _forward(model, batch, 0, 1, False, blks), None)
    n_chunks = len(_chunks(batch.ids.shape[0], batch_size))
    per_layer = 1 + sum(1 + len(g) for *_, g in plan)
    captures = n_chunks * (len(chosen) if keep_layers == "pair" else 1)
    total = captures + len(chosen) * per_layer
    np_dtype = np.dtype(dtype)
    results, divs, table, first_config = [], [], [], None
    with _progress.Progress(progress, total, desc="tokenwise_protocol", unit="step") as bar:
        states = {}
        if keep_layers == "all":
            need = set(chosen) | {l + 1 for l in chosen}
            states = _capture(model, batch, blks, need, np_dtype, batch_size, bar)
        for l in chosen:
            if keep_layers == "pair":
                states = _capture(model, batch, blks, {l, l + 1}, np_dtype, batch_size, bar)
            X, Y = states[l], states[l + 1]
            r = decompose(X, Y, k=k, cls=cls, ridge=ridge, prior=prior, exclude_self=exclude_self,
                          layer=l, **opts)
            bar.advance()
            div = _intervene(model, batch, blks, l, r.patched(X), probe_idx, divergence, readout_position,
                             readout, batch_size, bar)
            if keep_layers == "pair":
                states = {}
            del X, Y
            # the row now, so that keep_results=False holds one result at a time
            table.extend(layer_report([r], perturbations=[div]))
            divs.append(div)
            first_config = first_config or dict(r.config)
            if keep_results:
                results.append(r)
            del r
    import transformers

    model_dtype = _model_dtype(model)

    config = {
        "model": type(model).__name__,
        "name_or_path": getattr(getattr(model, "config", None), "_name_or_path", None),
        "model_dtype": None if model_dtype is None else str(model_dtype).replace("torch.", ""),
        "blocks": path, "n_blocks": L, "layers": list(chosen),
        "n_sequences": int(batch.ids.shape[0]), "n_tokens": int(n),
        "decompose": first_config,
        "cls": cls, "k": k, "ridge": ridge, "prior": prior, "exclude_self": exclude_self,
        "decompose_options": opts, "probe": int(probe_idx.size), "seed": seed,
        "divergence": divergence, "readout_position": readout_position,
        "readout": "model head" if readout is None else getattr(readout, "__name__", repr(readout)),
        "dtype": dtype, "keep_layers": keep_layers, "batch_size": batch_size,
        "torch": torch.__version__, "transformers": transformers.__version__,
    }
    return ProtocolResult(
        table=table, results=tuple(results), divergences=tuple(divs), sequence=batch.sequence,
        position=batch.position, probe=probe_idx, config=config,
    )
