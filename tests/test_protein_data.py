"""Protein data: parsers on real files (OpenFold's test data, the shipped chains), every bad
input, features, keyed crops, the dataset split, and the loss / contact precision by hand."""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from dspzoo.domains.protein.data import (
    GAP_ID,
    ProteinDataError,
    check_query,
    deletion_transform,
    merge_msas,
    msa_feat,
    parse_a3m,
    parse_fasta,
    parse_msa,
    parse_pdb,
    parse_stockholm,
    parse_structure,
    sequence_to_ids,
    target_feat,
)
from dspzoo.domains.protein.dataset import (
    BUILTIN_DATA,
    ProteinDataset,
    collate,
    crop_and_sample,
    is_held_out,
    sample_msa_rows,
    training_batch,
)
from dspzoo.domains.protein.metrics import (
    Bins,
    contact_precision,
    contact_precision_from_probs,
    distogram_loss,
    distogram_targets,
    separation_baseline,
    write_contact_png,
)

DATA = Path(__file__).parent / "data" / "protein"
CIF_2Q2K = DATA / "mmcif" / "2q2k.cif"
ALN = DATA / "alignments" / "2q2k_A"
QUERY_2Q2K = "MGSSHHHHHHSSGLVPGSHMDKKETKHLLKIKKEDYPQIFDFLENVPRGTKTAHIREALRRYIEEIGENP"


# -- structures ----------------------------------------------------------------------------


def test_2q2k_protein_chains_on_seqres_with_masks() -> None:
    chains = {c.name: c for c in parse_structure(CIF_2Q2K)}
    assert sorted(chains) == ["2q2k_A", "2q2k_B"]  # the DNA chain F is not a protein
    a, b = chains["2q2k_A"], chains["2q2k_B"]
    for chain in (a, b):
        assert chain.sequence == QUERY_2Q2K and len(chain) == 70 and chain.entry == "2q2k"
        np.testing.assert_array_equal(chain.residue_index, np.arange(70))
        assert chain.aatype.dtype == np.int64 and chain.pseudo_beta.shape == (70, 3)
    # observed: SEQRES 23..67 (A) and 23..66 (B), 1-based; the His tag is disordered
    np.testing.assert_array_equal(np.nonzero(a.observed)[0], np.arange(22, 67))
    np.testing.assert_array_equal(np.nonzero(b.observed)[0], np.arange(22, 66))
    np.testing.assert_array_equal(a.pseudo_beta_mask, a.observed.astype(np.float32))
    assert not a.pseudo_beta[~a.observed].any()
    # SEQRES 23 is LYS, author number 4: its CB, atom 412 of the file (chain A), 795 (chain B)
    np.testing.assert_allclose(a.pseudo_beta[22], [14.475, 23.944, 39.138], atol=1e-3)
    np.testing.assert_allclose(b.pseudo_beta[22], [34.765, 38.980, 18.734], atol=1e-3)
    only_b = parse_structure(CIF_2Q2K, chains=["B"])
    assert [c.name for c in only_b] == ["2q2k_B"]
    with pytest.raises(ProteinDataError, match=r"2q2k.cif: no protein chain\(s\) \['F'\]"):
        parse_structure(CIF_2Q2K, chains=["F"])


def test_selenomethionine_maps_to_methionine_with_its_cb() -> None:
    (chain,) = parse_structure(DATA / "mmcif" / "4zey.cif")
    assert chain.sequence.startswith("GMEGPLNL") and chain.aatype[
        1
    ] == "ARNDCQEGHILKMFPSTWYV".index("M")
    assert chain.observed[1] and chain.pseudo_beta_mask[1] == 1
    np.testing.assert_allclose(chain.pseudo_beta[1], [8.579, 23.745, 6.957], atol=1e-3)  # MSE CB


PDB_LINES = [
    "SEQRES   1 A    6  GLY ALA MSE SER LYS TRP",
    "SEQRES   1 B    2  ALA GLY",
]


def _atom(serial: int, name: str, resname: str, chain: str, number: int, xyz, het=False, icode=" "):
    record = "HETATM" if het else "ATOM  "
    x, y, z = xyz
    return (
        f"{record}{serial:5d} {name:<4s} {resname:>3s} {chain}{number:4d}{icode}   "
        f"{x:8.3f}{y:8.3f}{z:8.3f}  1.00  0.00           {name[0]}"
    )


def _pdb_file(tmp_path: Path, numbers=(10, 11, 12, 14, 15), icodes=None, extra_b=True) -> Path:
    """Chain A: SEQRES G A M S K W, observed G A MSE K W (S missing), numbered ``numbers``."""
    names = ["GLY", "ALA", "MSE", "LYS", "TRP"]
    lines, serial = list(PDB_LINES), 1
    for i, (resname, number) in enumerate(zip(names, numbers)):
        icode = (icodes or {}).get(i, " ")
        for atom in ("N", "CA", "C") + (() if resname == "GLY" else ("CB",)):
            xyz = (i * 3.8, {"N": 1.0, "CA": 0.0, "C": -1.0, "CB": 2.0}[atom], 0.5)
            lines.append(_atom(serial, atom, resname, "A", number, xyz, resname == "MSE", icode))
            serial += 1
    if extra_b:
        for j, resname in enumerate(("ALA", "GLY")):
            lines.append(_atom(serial, "CA", resname, "B", j + 1, (0.0, 0.0, 9.0 + j)))
            serial += 1
    lines.append(_atom(serial, "O", "HOH", "A", 200, (5.0, 5.0, 5.0), het=True))
    path = tmp_path / "toy.pdb"
    path.write_text("\n".join(lines + ["END", ""]))
    return path


def test_pdb_residues_placed_on_seqres_by_number(tmp_path: Path) -> None:
    path = _pdb_file(tmp_path)
    a, b = parse_pdb(path)
    assert a.name == "toy_A" and a.sequence == "GAMSKW"
    np.testing.assert_array_equal(a.observed, [1, 1, 1, 0, 1, 1])  # SER (number 13) missing
    np.testing.assert_allclose(a.pseudo_beta[0], [0.0, 0.0, 0.5])  # glycine: its CA
    np.testing.assert_allclose(a.pseudo_beta[2], [7.6, 2.0, 0.5], atol=1e-3)  # MSE: its CB
    np.testing.assert_allclose(a.pseudo_beta[4], [11.4, 2.0, 0.5], atol=1e-3)
    # chain B has only CA atoms: observed, but the alanine has no CB; the glycine uses its CA
    np.testing.assert_array_equal(b.observed, [1, 1])
    np.testing.assert_array_equal(b.pseudo_beta_mask, [0, 1])
    # insertion codes break the numbering: the residues are placed by alignment instead
    shifted = _pdb_file(tmp_path, numbers=(1, 1, 2, 3, 4), icodes={1: "A"}, extra_b=False)
    (c,) = parse_pdb(shifted, chains=["A"])
    np.testing.assert_array_equal(c.observed, [1, 1, 1, 0, 1, 1])


def test_pdb_without_seqres_uses_the_observed_residues(tmp_path: Path) -> None:
    path = _pdb_file(tmp_path, numbers=(10, 11, 12, 20, 21), extra_b=False)
    path.write_text(
        "\n".join(line for line in path.read_text().splitlines() if "SEQRES" not in line)
    )
    (chain,) = parse_pdb(path)
    assert chain.sequence == "GAMKW" and chain.observed.all()
    np.testing.assert_array_equal(chain.residue_index, [0, 1, 2, 10, 11])  # the gap stays


def test_shipped_chains_parse() -> None:
    files = sorted(BUILTIN_DATA.glob("*.gz"))
    assert len(files) >= 50
    (chain,) = parse_structure(BUILTIN_DATA / "1ahsA.pdb.gz")
    assert chain.name == "1ahsA_A" and len(chain) == 126 and chain.sequence.startswith("TGPYAGAVEV")
    assert chain.pseudo_beta_mask.all()


# -- sequences and alignments --------------------------------------------------------------


def test_fasta_and_sequences() -> None:
    ((description, sequence),) = parse_fasta(DATA / "short.fasta")
    assert description == "query" and len(sequence) == 73 and sequence.startswith("MAAHKG")
    np.testing.assert_array_equal(sequence_to_ids("ARX"), [0, 1, 20])
    np.testing.assert_array_equal(sequence_to_ids("UOB"), [4, 11, 20])  # Sec→C, Pyl→K, B→X


def test_a3m_rows_and_deletion_matrix() -> None:
    msa = parse_a3m(ALN / "bfd_uniclust_hits.a3m")
    assert msa.rows.shape == msa.deletions.shape == (4, 70)
    assert msa.query() == QUERY_2Q2K
    # last row "...YINDLGDTpP": the lowercase p is one deletion before the last column
    last = msa.rows[3]
    assert (last[:19] == GAP_ID).all() and "".join(
        "ARNDCQEGHILKMFPSTWYV"[i] for i in last[-4:]
    ) == "GDTP"
    expected = np.zeros(70, dtype=np.int64)
    expected[69] = 1
    np.testing.assert_array_equal(msa.deletions[3], expected)
    assert msa.deletions[:3].sum() == 0


def test_stockholm_insert_columns_become_deletions() -> None:
    mgnify = parse_stockholm(ALN / "mgnify_hits.sto")
    assert mgnify.rows.shape == (7, 70) and mgnify.deletions.sum() == 0
    uniref = parse_msa(ALN / "uniref90_hits.sto")
    assert uniref.rows.shape == (16, 70) and uniref.query() == QUERY_2Q2K
    # the query has gaps in alignment columns 17 and 26; UPI0014612D4C has an R in column 17
    # (one deletion before query residue 17), UPI000B802FE5 an R and a Q (17 and 25)
    rows = {name.split("/")[0]: i for i, name in enumerate(uniref.names)}
    assert np.nonzero(uniref.deletions[rows["UniRef90_UPI0014612D4C"]])[0].tolist() == [16]
    assert np.nonzero(uniref.deletions[rows["UniRef90_UPI000B802FE5"]])[0].tolist() == [16, 24]
    assert uniref.deletions.sum() == 4


def test_merged_msa_is_deduplicated() -> None:
    msas = [parse_msa(p) for p in sorted(ALN.iterdir())]
    merged = merge_msas(QUERY_2Q2K, msas)
    # 1 + 4 + 7 + 16 rows; dropped: the three files' query rows, one repeated MGnify row and
    # four UniRef90 rows equal to earlier ones (A0A141BHY3, UPI0005E12F5A, UPI000DA9B884,
    # A0A0Q9XW80) — counted by hand from the files
    assert merged.rows.shape == (20, 70) and merged.deletions.shape == (20, 70)
    assert merged.names[0] == "query" and len(merged.names) == 20
    assert len({r.tobytes() for r in merged.rows}) == 20
    assert merge_msas(QUERY_2Q2K, msas, dedup=False).depth == 28


# -- bad inputs ----------------------------------------------------------------------------


def _raises(match: str, fn, *args, **kw) -> str:
    with pytest.raises(ProteinDataError, match=match) as info:
        fn(*args, **kw)
    return str(info.value)


def test_corrupt_and_inconsistent_inputs_name_the_file(tmp_path: Path) -> None:
    text = CIF_2Q2K.read_text()
    cut = tmp_path / "cut.cif"
    cut.write_text(text[: len(text) // 2])
    assert "cut.cif" in _raises("truncated mmCIF", parse_structure, cut)
    lines = text.splitlines(keepends=True)
    at_line = tmp_path / "cut_at_line.cif"
    at_line.write_text("".join(lines[:2200]))  # inside _pdbx_poly_seq_scheme
    _raises(r"cut_at_line.cif: chain 'B' has 25 residues .* \(truncated", parse_structure, at_line)
    gz = tmp_path / "broken.cif.gz"
    gz.write_bytes(gzip.compress(text.encode())[:500])
    _raises("broken.cif.gz: cannot be read", parse_structure, gz)
    _raises(r"x.xyz: unknown structure format", parse_structure, tmp_path / "x.xyz")
    _raises(r"missing.cif: no such file", parse_structure, tmp_path / "missing.cif")

    ragged = tmp_path / "ragged.a3m"
    ragged.write_text(">q\nMKV\n>h1\nMK\n")
    _raises(
        r"ragged.a3m: MSA rows have different lengths: .* row 2 \('h1'\) has 2", parse_a3m, ragged
    )
    sto = tmp_path / "ragged.sto"
    sto.write_text("# STOCKHOLM 1.0\n\nq   MKV\nh1  MK\n//\n")
    _raises("ragged.sto", parse_stockholm, sto)
    letters = tmp_path / "letters.a3m"
    letters.write_text(">q\nMKV\n>h1\nM1V\n")
    _raises(r"letters.a3m: row 2 \('h1'\): unknown residue letter '1'", parse_a3m, letters)
    fasta = tmp_path / "bad.fasta"
    fasta.write_text(">q\nMK?V\n")
    _raises(r"bad.fasta: record 'q': unknown residue letter '\?' at position 3", parse_fasta, fasta)
    empty = tmp_path / "empty.fasta"
    empty.write_text("\n")
    _raises("empty.fasta: no '>' records", parse_fasta, empty)
    other = tmp_path / "other.a3m"
    other.write_text(">q\nMKW\n>h\nMK-\n")
    _raises(
        r"other.a3m: the MSA's first row differs from the query sequence at position 3",
        check_query,
        parse_a3m(other),
        "MKV",
    )
    _raises("first row has 3 columns", merge_msas, "MKVL", [parse_a3m(other)])

    # a chain with SEQRES but no observed residue, and a file without atoms
    path = _pdb_file(tmp_path)
    lines = [
        ln for ln in path.read_text().splitlines() if not (ln.startswith("ATOM") and ln[21] == "B")
    ]
    path.write_text("\n".join(lines) + "\n")
    _raises(r"toy.pdb: chain 'B' has no observed residues", parse_pdb, path)
    blank = tmp_path / "blank.pdb"
    blank.write_text("HEADER    NOTHING\nEND\n")
    _raises("blank.pdb: no ATOM/HETATM records", parse_pdb, blank)
    # an observed residue that contradicts SEQRES
    wrong = _pdb_file(tmp_path)
    wrong.write_text(
        wrong.read_text().replace(
            "SEQRES   1 A    6  GLY ALA MSE SER LYS TRP",
            "SEQRES   1 A    6  GLY ALA MSE SER LYS PHE",
        )
    )
    _raises("cannot be placed on the SEQRES sequence", parse_pdb, wrong)
    (tmp_path / "nothing_here").mkdir()
    with pytest.raises(ProteinDataError, match="nothing_here: no structure files"):
        ProteinDataset(tmp_path / "nothing_here")
    with pytest.raises(ProteinDataError, match="absent: not a folder"):
        ProteinDataset(tmp_path / "absent")


# -- features, crops, dataset --------------------------------------------------------------


def test_feature_layout() -> None:
    aatype = sequence_to_ids("AGX")
    tf = target_feat(aatype)
    assert tf.shape == (3, 22) and tf[:, 0].sum() == 0
    assert tf[0, 1] == tf[1, 1 + 7] == tf[2, 21] == 1 and tf.sum() == 3
    rows = np.array([[0, 7, 20], [0, GAP_ID, 1]])
    dels = np.array([[0, 0, 0], [0, 3, 0]])
    mf = msa_feat(rows, dels)
    assert mf.shape == (2, 3, 49)
    assert mf[1, 1, GAP_ID] == 1 and mf[1, 1, 23] == 1 and mf[0, 1, 23] == 0
    assert mf[1, 1, 24] == pytest.approx(2 / math.pi * math.atan(1.0))
    np.testing.assert_allclose(mf[0, 0, 25:48].sum(), 1.0)
    assert mf[0, 1, 25 + 7] == mf[0, 1, 25 + GAP_ID] == 0.5  # column profile, broadcast
    assert mf[1, 1, 48] == pytest.approx(float(deletion_transform(np.array(1.5))))  # mean 1.5


def _sample(length: int = 100, depth: int = 12) -> dict:
    gen = np.random.default_rng(0)
    return {
        "name": "toy_A",
        "aatype": gen.integers(0, 20, length),
        "residue_index": np.arange(length),
        "pseudo_beta": gen.normal(size=(length, 3)).astype(np.float32),
        "pseudo_beta_mask": np.ones(length, dtype=np.float32),
        "msa": gen.integers(0, 22, (depth, length)),
        "deletions": gen.integers(0, 3, (depth, length)),
    }


def test_crops_and_msa_rows_are_keyed() -> None:
    sample = _sample()
    a = crop_and_sample(sample, 32, 5, key=123)
    b = crop_and_sample(sample, 32, 5, key=123)
    for k in ("aatype", "msa", "deletions", "pseudo_beta"):
        np.testing.assert_array_equal(a[k], b[k])
    assert a["aatype"].shape == (32,) and a["msa"].shape == (5, 32)
    starts = {int(crop_and_sample(sample, 32, 5, key=k)["residue_index"][0]) for k in range(20)}
    assert len(starts) > 5 and max(starts) <= 68  # uniform over the 69 possible starts
    rows = sample_msa_rows(12, 5, torch.Generator().manual_seed(0))
    assert rows[0] == 0 and len(set(rows.tolist())) == 5 and rows.max() < 12
    assert crop_and_sample(sample, 200, 50, key=1)["msa"].shape == (12, 100)  # short: whole
    # a training batch depends on (seed, step, sample index) only
    one = training_batch(
        [sample, _sample(60, 3)],
        seed=0,
        step=4,
        sample_indices=[8, 9],
        crop_size=40,
        max_msa_rows=4,
    )
    two = training_batch([sample], seed=0, step=4, sample_indices=[8], crop_size=40, max_msa_rows=4)
    torch.testing.assert_close(one["msa_feat"][:1], two["msa_feat"])
    other = training_batch(
        [sample], seed=0, step=5, sample_indices=[8], crop_size=40, max_msa_rows=4
    )
    assert not torch.equal(other["aatype"], two["aatype"])


def test_collate_pads_with_masks() -> None:
    batch = collate(
        [
            crop_and_sample(_sample(10, 4), None, 4, None),
            crop_and_sample(_sample(7, 2), None, 4, None),
        ]
    )
    shapes = {k: tuple(v.shape) for k, v in batch.items()}
    assert shapes == {
        "aatype": (2, 10), "target_feat": (2, 10, 22), "msa_feat": (2, 4, 10, 49),
        "residue_index": (2, 10), "seq_mask": (2, 10), "msa_mask": (2, 4, 10),
        "pseudo_beta": (2, 10, 3), "pseudo_beta_mask": (2, 10),
    }  # fmt: skip
    assert batch["seq_mask"][1].tolist() == [1] * 7 + [0] * 3
    assert batch["msa_mask"][1].sum() == 2 * 7 and batch["aatype"][1, 7:].eq(20).all()
    assert (
        batch["msa_feat"][1, 2:].abs().sum() == 0 and batch["target_feat"][1, 7:].abs().sum() == 0
    )


def test_dataset_split_is_by_entry() -> None:
    train = ProteinDataset(BUILTIN_DATA, "train")
    held = ProteinDataset(BUILTIN_DATA, "held_out")
    entries = lambda ds: {n.rsplit("_", 1)[0] for n in ds.names}  # noqa: E731
    assert not entries(train) & entries(held) and len(train) >= 40 and len(held) >= 5
    assert all(is_held_out(e, 0.1) for e in entries(held))
    assert {"2q2k_A", "2q2k_B"} <= set(train.names) or {"2q2k_A", "2q2k_B"} <= set(held.names)
    with_msa = next(s for s in train.samples + held.samples if s["name"] == "2q2k_A")
    assert with_msa["msa"].shape == (20, 70)  # the shipped alignments, merged and deduplicated


def test_explicit_held_out_entries(tmp_path: Path) -> None:
    for name in ("1ahsA.pdb.gz", "2cviA.pdb.gz", "4zey.cif.gz"):
        (tmp_path / name).write_bytes((BUILTIN_DATA / name).read_bytes())
    fixed = ProteinDataset(tmp_path, "held_out", held_out_entries=["1ahsA", "4ZEY"])
    assert sorted(fixed.names) == ["1ahsA_A", "4zey_A"]
    assert ProteinDataset(tmp_path, "train", held_out_entries=["1ahsA", "4zey"]).names == [
        "2cviA_A"
    ]
    with pytest.raises(ProteinDataError, match="no chains in the 'train' split"):
        ProteinDataset(tmp_path, "train", held_out_entries=["1ahsA", "2cviA", "4zey"])


# -- loss and precision by hand ------------------------------------------------------------


def test_distogram_loss_by_hand() -> None:
    class Cfg:
        distogram_bins, first_break, last_break = 3, 4.0, 8.0  # boundaries 4, 8

    pb = torch.tensor([[[0.0, 0, 0], [5.0, 0, 0], [0.0, 9.0, 0]]])  # d01 = 5, d02 = 9, d12 = √106
    targets = distogram_targets(pb, Bins.of(Cfg))
    assert targets[0].tolist() == [[0, 1, 2], [1, 0, 2], [2, 2, 0]]
    logits = torch.zeros(1, 3, 3, 3)
    logits[0, 0, 1] = torch.tensor([0.0, math.log(3.0), 0.0])  # p(bin 1) = 3/5
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # residue 2 unknown: pairs (0,0) (0,1) (1,0) (1,1)
    expected = (math.log(3) + math.log(5 / 3) + 2 * math.log(3)) / 4  # (1,0) uniform
    assert float(distogram_loss(logits, pb, mask, Cfg)) == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="bins"):
        distogram_loss(torch.zeros(1, 3, 3, 5), pb, mask, Cfg)


def test_contact_precision_by_hand(tmp_path: Path) -> None:
    r = 30
    pb = torch.zeros(1, r, 3)
    pb[0, :, 0] = torch.arange(r) * 10.0  # everything far apart ...
    pb[0, 25, 0] = pb[0, 0, 0] + 5.0  # ... except the contacts (0, 25) and (1, 26), |i-j| = 25
    pb[0, 26, 0] = pb[0, 1, 0] + 5.0
    mask = torch.ones(1, r)
    probs = torch.zeros(1, r, r)
    for i, j, p in [(0, 25, 0.9), (1, 26, 0.8), (2, 28, 0.95), (3, 29, 0.7), (4, 29, 0.6),
                    (5, 29, 0.5), (0, 10, 0.99)]:  # fmt: skip
        probs[0, i, j] = probs[0, j, i] = p
    # L = 30 → top 6 long-range pairs: (2,28) (0,25) (1,26) (3,29) (4,29) (5,29); 2 contacts;
    # (0,10) is short-range and ignored
    got = contact_precision_from_probs(probs, pb, mask)
    assert float(got[0]) == pytest.approx(2 / 6)
    mask[0, 2] = 0  # residue 2 unobserved: (2,28) leaves the candidates, (0,0) pairs fill in
    assert float(contact_precision_from_probs(probs, pb, mask)[0]) == pytest.approx(2 / 6)
    # from logits: all mass in bin 0 for the two true contacts → precision 2 / 6 with ties at 0
    logits = torch.full((1, r, r, 64), -30.0)
    logits[..., -1] = 0.0
    logits[0, 0, 25, 0] = logits[0, 25, 0, 0] = logits[0, 1, 26, 0] = logits[0, 26, 1, 0] = 30.0
    top = contact_precision(logits, pb, torch.ones(1, r), top_fraction=2 / 30)
    assert float(top[0]) == 1.0
    baseline = separation_baseline(torch.arange(4)[None])[0, 0]
    torch.testing.assert_close(baseline, torch.tensor([1.0, 1 / 2, 1 / 3, 1 / 4]))
    png = write_contact_png(tmp_path / "c.png", probs[0], pb[0], mask[0], "toy")
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
