"""Protein inputs from files: sequences (FASTA), alignments (A3M, Stockholm), structures
(mmCIF, PDB), and the model's features built from them.

Everything here is plain NumPy (no torch) and deterministic. Parsers return small dataclasses:

* :class:`Chain` — one protein chain on its SEQRES sequence: residue types, the residue index,
  and per residue the pseudo-β position (Cβ; Cα for glycine) with a mask that is 1 only where
  the residue was observed and has that atom. Observed residues are placed on the SEQRES
  sequence by residue number (mmCIF: ``_pdbx_poly_seq_scheme``; PDB: the ``SEQRES`` records and
  the residue numbers, see :func:`parse_pdb`); non-standard residues are mapped to their parent
  (``MSE`` → ``M``, Biopython's ``protein_letters_3to1_extended`` table).
* :class:`MSA` — aligned rows ``[S, L]`` (AF2 residue ids: 0..19 amino acids in the order
  ``ARNDCQEGHILKMFPSTWYV``, 20 = X, 21 = gap) and the deletion matrix ``[S, L]`` (how many
  residues were deleted before each column: lowercase letters of A3M, insert columns of
  Stockholm).

Every corrupt or inconsistent input raises :class:`ProteinDataError` naming the file and what
is wrong (truncated mmCIF, MSA rows of different lengths, a query that does not match the
MSA's first row, unknown residue letters, chains without observed residues, ...).
"""

from __future__ import annotations

import gzip
import io
import math
import os
import re
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ...core.errors import UsageError

RESTYPES = "ARNDCQEGHILKMFPSTWYV"
"""The 20 standard residues in AlphaFold-2 order (``aatype`` 0..19)."""
X_ID, GAP_ID, MASK_ID = 20, 21, 22
NUM_MSA_CLASSES = 23  # 20 amino acids, X, gap, mask
TARGET_FEAT_DIM = 22  # break flag + one-hot of aatype 0..20
MSA_FEAT_DIM = 49  # 23 one-hot + has_deletion + deletion_value + 23 profile + deletion_mean

# one-letter codes accepted in sequences: the 20, X, and IUPAC codes mapped to a parent or X
_LETTER_TO_ID = {letter: i for i, letter in enumerate(RESTYPES)}
_LETTER_TO_ID.update({"X": X_ID, "B": X_ID, "Z": X_ID, "J": X_ID, "U": 4, "O": 11})
_MSA_LETTER_TO_ID = {**_LETTER_TO_ID, "-": GAP_ID}

STRUCTURE_SUFFIXES = (".cif", ".mmcif", ".pdb", ".ent")


class ProteinDataError(UsageError):
    """A protein input file is corrupt or inconsistent; the message names the file."""


# -- sequences -----------------------------------------------------------------------------


def sequence_to_ids(sequence: str, where: str = "sequence") -> np.ndarray:
    """One-letter sequence → ``aatype`` ``[L]`` int64 (0..19, 20 = X); unknown letters raise.

    ``U`` (selenocysteine) maps to C, ``O`` (pyrrolysine) to K, ``B``/``Z``/``J``/``X`` to X.
    """
    ids = np.empty(len(sequence), dtype=np.int64)
    for i, letter in enumerate(sequence.upper()):
        if letter not in _LETTER_TO_ID:
            raise ProteinDataError(
                f"{where}: unknown residue letter {letter!r} at position {i + 1}; expected one of "
                f"{RESTYPES}, X or B/Z/J/U/O"
            )
        ids[i] = _LETTER_TO_ID[letter]
    return ids


def ids_to_sequence(ids: Iterable[int]) -> str:
    """``aatype`` ids → one-letter sequence (20 → X)."""
    return "".join(RESTYPES[i] if i < 20 else "X" for i in ids)


def _open_text(path: Path) -> str:
    """A text file's content (``.gz`` decompressed); a clear error when it cannot be read."""
    try:
        raw = path.read_bytes()
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
        return raw.decode("utf-8", errors="replace")
    except FileNotFoundError:
        raise ProteinDataError(f"{path}: no such file") from None
    except (OSError, EOFError) as exc:
        raise ProteinDataError(f"{path}: cannot be read ({exc})") from exc


def _fasta_records(text: str, where: str) -> list[tuple[str, str]]:
    """``(description, sequence)`` records of FASTA/A3M text (sequence lines joined)."""
    records: list[tuple[str, list[str]]] = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith(">"):
            records.append((line[1:].strip(), []))
        elif not records:
            raise ProteinDataError(
                f"{where}: line {number} has sequence data before any '>' header"
            )
        else:
            records[-1][1].append(line)
    out = [(desc, "".join(lines)) for desc, lines in records]
    for desc, seq in out:
        if not seq:
            raise ProteinDataError(f"{where}: record {desc!r} has an empty sequence")
    if not out:
        raise ProteinDataError(f"{where}: no '>' records found (empty or not FASTA)")
    return out


def parse_fasta(path: str | os.PathLike) -> list[tuple[str, str]]:
    """``(description, sequence)`` of every record of a FASTA file (sequences upper-cased and
    checked: unknown residue letters raise)."""
    path = Path(path)
    records = _fasta_records(_open_text(path), str(path))
    out = []
    for desc, seq in records:
        seq = seq.upper().replace("*", "") if seq.endswith("*") else seq.upper()
        sequence_to_ids(seq, f"{path}: record {desc!r}")
        out.append((desc, seq))
    return out


# -- alignments ----------------------------------------------------------------------------


@dataclass
class MSA:
    """A multiple sequence alignment on the query's columns.

    Attributes:
        rows: ``[S, L]`` int64 residue ids (0..19, 20 = X, 21 = gap); row 0 is the query.
        deletions: ``[S, L]`` int64, residues deleted before each column in each row.
        names: ``S`` row names.
        source: where the rows came from (file names), for messages.
    """

    rows: np.ndarray
    deletions: np.ndarray
    names: list[str]
    source: str = ""

    @property
    def depth(self) -> int:
        return int(self.rows.shape[0])

    @property
    def length(self) -> int:
        return int(self.rows.shape[1])

    def query(self) -> str:
        """The first row as a one-letter sequence (gaps as '-')."""
        return "".join("-" if i == GAP_ID else ids_to_sequence([i]) for i in self.rows[0])


def _msa_row_ids(aligned: str, where: str) -> np.ndarray:
    ids = np.empty(len(aligned), dtype=np.int64)
    for i, letter in enumerate(aligned):
        if letter not in _MSA_LETTER_TO_ID:
            raise ProteinDataError(
                f"{where}: unknown residue letter {letter!r} at aligned column {i + 1}; expected "
                f"one of {RESTYPES}, X, B/Z/J/U/O or '-'"
            )
        ids[i] = _MSA_LETTER_TO_ID[letter]
    return ids


def _check_rows(lengths: Sequence[int], names: Sequence[str], where: str) -> None:
    if len(set(lengths)) > 1:
        first = lengths[0]
        bad = next(i for i, n in enumerate(lengths) if n != first)
        raise ProteinDataError(
            f"{where}: MSA rows have different lengths: row 1 ({names[0]!r}) has {first} "
            f"aligned columns, row {bad + 1} ({names[bad]!r}) has {lengths[bad]}"
        )


def parse_a3m(path: str | os.PathLike) -> MSA:
    """An A3M alignment: uppercase letters and ``-`` are match columns; lowercase letters are
    insertions, removed and counted in the deletion matrix at the next match column (``.`` is
    removed without counting). Rows of different lengths or unknown letters raise."""
    path = Path(path)
    where = str(path)
    records = _fasta_records(_open_text(path), where)
    rows, dels, names, lengths = [], [], [], []
    for r, (desc, seq) in enumerate(records):
        aligned: list[str] = []
        counts: list[int] = []
        pending = 0
        for letter in seq:
            if letter.islower():
                pending += 1
            elif letter == ".":
                continue
            else:
                aligned.append(letter)
                counts.append(pending)
                pending = 0
        text = "".join(aligned)
        rows.append(_msa_row_ids(text, f"{where}: row {r + 1} ({desc.split()[0]!r})"))
        dels.append(np.asarray(counts, dtype=np.int64))
        names.append(desc.split()[0] if desc else f"row{r + 1}")
        lengths.append(len(text))
    _check_rows(lengths, names, where)
    return MSA(np.stack(rows), np.stack(dels), names, where)


def parse_stockholm(path: str | os.PathLike) -> MSA:
    """A Stockholm alignment (``Bio.AlignIO``): columns where the first row (the query) has a
    gap are removed, and each row's residues in them are counted as deletions before the next
    kept column. Rows of different lengths or unknown letters raise."""
    from Bio import AlignIO

    path = Path(path)
    where = str(path)
    text = _open_text(path)
    try:
        alignment = AlignIO.read(io.StringIO(text), "stockholm")
    except ValueError as exc:
        lengths_msg = str(exc)
        raise ProteinDataError(
            f"{where}: not a valid Stockholm alignment ({lengths_msg}); check that every row "
            f"has the same number of columns and the file ends with '//'"
        ) from exc
    records = [(rec.id, str(rec.seq)) for rec in alignment]
    if not records:
        raise ProteinDataError(f"{where}: the Stockholm alignment has no rows")
    names = [name for name, _ in records]
    _check_rows([len(s) for _, s in records], names, where)
    query = records[0][1]
    keep = [i for i, letter in enumerate(query) if letter not in "-."]
    if not keep:
        raise ProteinDataError(f"{where}: the first row (the query) is all gaps")
    rows, dels = [], []
    for r, (name, seq) in enumerate(records):
        seq = seq.upper().replace(".", "-")
        aligned: list[str] = []
        counts: list[int] = []
        pending = 0
        kept = set(keep)
        for i, letter in enumerate(seq):
            if i in kept:
                aligned.append(letter)
                counts.append(pending)
                pending = 0
            elif letter != "-":
                pending += 1
        rows.append(_msa_row_ids("".join(aligned), f"{where}: row {r + 1} ({name!r})"))
        dels.append(np.asarray(counts, dtype=np.int64))
    return MSA(np.stack(rows), np.stack(dels), names, where)


def parse_msa(path: str | os.PathLike) -> MSA:
    """An alignment file by its suffix: ``.a3m`` or ``.sto``/``.stockholm`` (optionally ``.gz``)."""
    path = Path(path)
    name = path.name.lower().removesuffix(".gz")
    if name.endswith(".a3m"):
        return parse_a3m(path)
    if name.endswith((".sto", ".stockholm")):
        return parse_stockholm(path)
    raise ProteinDataError(f"{path}: unknown alignment format; expected .a3m or .sto")


def check_query(msa: MSA, sequence: str, where: str | None = None) -> None:
    """Raise unless the MSA's first row, gaps removed, is ``sequence`` (column for column)."""
    query = msa.query()
    if len(query) != len(sequence) or "-" in query:
        raise ProteinDataError(
            f"{where or msa.source}: the MSA's first row has {len(query)} columns "
            f"({query.count('-')} gaps) but the query sequence has {len(sequence)} residues; "
            f"the first row must be the query itself"
        )
    expected = ids_to_sequence(sequence_to_ids(sequence, where or msa.source))
    if query != expected:
        pos = next(i for i, (a, b) in enumerate(zip(query, expected)) if a != b)
        raise ProteinDataError(
            f"{where or msa.source}: the MSA's first row differs from the query sequence at "
            f"position {pos + 1} ({query[pos]!r} vs {expected[pos]!r}); the first row must be "
            f"the query itself"
        )


def merge_msas(sequence: str, msas: Sequence[MSA], dedup: bool = True) -> MSA:
    """The query row followed by the rows of every MSA (each checked against ``sequence``),
    with later copies of an identical aligned row dropped when ``dedup``. ``[S, L]``."""
    query = sequence_to_ids(sequence)
    rows = [query[None]]
    dels = [np.zeros((1, len(query)), dtype=np.int64)]
    names = ["query"]
    for msa in msas:
        check_query(msa, sequence)
        rows.append(msa.rows)
        dels.append(msa.deletions)
        names.extend(msa.names)
    all_rows, all_dels = np.concatenate(rows), np.concatenate(dels)
    if dedup:
        keep = deduplicate_rows(all_rows)
        all_rows, all_dels = all_rows[keep], all_dels[keep]
        names = [names[i] for i in keep]
    return MSA(all_rows, all_dels, names, ", ".join(m.source for m in msas))


def deduplicate_rows(rows: np.ndarray) -> list[int]:
    """Indices of the first occurrence of every distinct row of ``rows`` ``[S, L]``, in order."""
    seen: set[bytes] = set()
    keep = []
    for i, row in enumerate(rows):
        key = row.tobytes()
        if key not in seen:
            seen.add(key)
            keep.append(i)
    return keep


# -- structures ----------------------------------------------------------------------------


@dataclass
class Chain:
    """One protein chain on its SEQRES sequence (``L`` residues).

    Attributes:
        name: ``<entry>_<chain id>``, e.g. ``2q2k_A`` (the alignment folder name).
        entry: the file's entry id (the train/held-out split is by entry).
        sequence: one-letter SEQRES sequence (non-standard residues mapped, unknown → X).
        aatype: ``[L]`` int64 residue ids.
        residue_index: ``[L]`` int64, the SEQRES position (0-based; without SEQRES the author
            residue number minus the first one, so numbering gaps stay gaps).
        observed: ``[L]`` bool, residue present in the structure (with a Cα).
        pseudo_beta: ``[L, 3]`` float32 Å, Cβ (Cα for glycine); 0 where missing.
        pseudo_beta_mask: ``[L]`` float32, 1 where the residue was observed with that atom.
        source: the file it came from.
    """

    name: str
    entry: str
    sequence: str
    aatype: np.ndarray
    residue_index: np.ndarray
    observed: np.ndarray
    pseudo_beta: np.ndarray
    pseudo_beta_mask: np.ndarray
    source: str = ""
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.sequence)


def three_to_one(resname: str) -> str | None:
    """One-letter parent of a residue name (``MSE`` → ``M``, ``UNK`` → ``X``), ``None`` if it is
    not an amino acid."""
    from Bio.Data.PDBData import protein_letters_3to1_extended

    name = resname.strip().upper()
    if name == "UNK":
        return "X"
    letter = protein_letters_3to1_extended.get(name)
    return letter if letter in _LETTER_TO_ID else None


def _pseudo_beta(residue, letter: str) -> np.ndarray | None:
    atom = "CA" if letter == "G" else "CB"
    if atom in residue:
        return np.asarray(residue[atom].get_coord(), dtype=np.float32)
    return None


def entry_of(path: Path) -> str:
    """The entry id of a structure file: its name without ``.gz`` and the format suffix."""
    name = path.name
    if name.lower().endswith(".gz"):
        name = name[:-3]
    stem, _, suffix = name.rpartition(".")
    return stem if stem and "." + suffix.lower() in STRUCTURE_SUFFIXES else name


def structure_format(path: Path) -> str:
    """``"mmcif"`` or ``"pdb"`` from the file name (``.gz`` allowed); other names raise."""
    name = path.name.lower().removesuffix(".gz")
    if name.endswith((".cif", ".mmcif")):
        return "mmcif"
    if name.endswith((".pdb", ".ent")):
        return "pdb"
    raise ProteinDataError(
        f"{path}: unknown structure format; expected .cif/.mmcif or .pdb/.ent (optionally .gz)"
    )


def parse_structure(path: str | os.PathLike, chains: Sequence[str] | None = None) -> list[Chain]:
    """Every protein chain of an mmCIF or PDB file (or those named in ``chains``)."""
    path = Path(path)
    if structure_format(path) == "mmcif":
        return parse_mmcif(path, chains)
    return parse_pdb(path, chains)


def _first_model(structure, where: str):
    models = list(structure)
    if not models:
        raise ProteinDataError(f"{where}: no atoms (no model) in the file")
    return models[0]


def _build_chain(
    name: str,
    entry: str,
    letters: list[str],
    residue_index: np.ndarray,
    placed: dict[int, object],
    where: str,
) -> Chain:
    """A :class:`Chain` from SEQRES letters and the observed residue at each position."""
    length = len(letters)
    observed = np.zeros(length, dtype=bool)
    coords = np.zeros((length, 3), dtype=np.float32)
    mask = np.zeros(length, dtype=np.float32)
    for i, residue in placed.items():
        if "CA" not in residue:
            continue
        observed[i] = True
        xyz = _pseudo_beta(residue, letters[i])
        if xyz is not None:
            coords[i], mask[i] = xyz, 1.0
    if not observed.any():
        raise ProteinDataError(
            f"{where}: chain {name.rsplit('_', 1)[-1]!r} has no observed residues (no Cα atoms); "
            f"the chain is empty or the file is truncated"
        )
    sequence = "".join(letters)
    return Chain(
        name=name,
        entry=entry,
        sequence=sequence,
        aatype=sequence_to_ids(sequence, where),
        residue_index=residue_index.astype(np.int64),
        observed=observed,
        pseudo_beta=coords,
        pseudo_beta_mask=mask,
        source=where,
    )


def _mmcif_column(data: dict, key: str, where: str) -> list[str]:
    value = data.get(key)
    if value is None:
        raise ProteinDataError(f"{where}: mmCIF item {key} is missing (truncated or not mmCIF?)")
    return value if isinstance(value, list) else [value]


def _mmcif_loop(data: dict, category: str, keys: Sequence[str], where: str) -> list[dict]:
    columns = {k: _mmcif_column(data, f"{category}.{k}", where) for k in keys}
    lengths = {k: len(v) for k, v in columns.items()}
    if len(set(lengths.values())) != 1:
        raise ProteinDataError(
            f"{where}: the {category} loop has columns of different lengths {lengths}: the file "
            f"is truncated or corrupt"
        )
    n = next(iter(lengths.values()))
    return [{k: columns[k][i] for k in keys} for i in range(n)]


def _check_complete(data: dict, text: str, where: str) -> None:
    """Signs of a cut file: a last line without its newline, or a loop whose columns have
    different lengths (a row cut short)."""
    if not text.endswith("\n"):
        tail = text.rstrip().splitlines()[-1][:60] if text.strip() else ""
        raise ProteinDataError(
            f"{where}: the file ends in the middle of a line ({tail!r}): truncated mmCIF"
        )
    lengths: dict[str, set[int]] = {}
    for key, value in data.items():
        if isinstance(value, list) and "." in key:
            lengths.setdefault(key.split(".", 1)[0], set()).add(len(value))
    ragged = sorted(category for category, sizes in lengths.items() if len(sizes) > 1)
    if ragged:
        raise ProteinDataError(
            f"{where}: loop(s) {ragged} have columns of different lengths: truncated or "
            f"corrupt mmCIF"
        )


def parse_mmcif(path: str | os.PathLike, chains: Sequence[str] | None = None) -> list[Chain]:
    """Protein chains of an mmCIF file, each on its SEQRES sequence.

    SEQRES positions and their author numbering come from ``_pdbx_poly_seq_scheme``; the
    coordinates (first model, highest-occupancy alternate locations) from ``Bio.PDB``'s
    ``MMCIFParser``; an observed residue is placed at the SEQRES position with its author
    chain, number and insertion code, and its name must match that position's residue. Only
    ``polypeptide(L)`` entities count. ``chains``: author chain ids to keep (default: all).
    """
    from Bio.PDB import MMCIFParser
    from Bio.PDB.MMCIF2Dict import MMCIF2Dict

    path = Path(path)
    where = str(path)
    text = _open_text(path)
    if not text.lstrip().startswith("data_"):
        raise ProteinDataError(f"{where}: not an mmCIF file (it does not start with 'data_')")
    try:
        data = MMCIF2Dict(io.StringIO(text))
    except (ValueError, IndexError, KeyError) as exc:
        raise ProteinDataError(f"{where}: corrupt mmCIF ({exc})") from exc
    _check_complete(data, text, where)
    entry = entry_of(path)
    entity_types = dict(
        zip(
            _mmcif_column(data, "_entity_poly.entity_id", where),
            _mmcif_column(data, "_entity_poly.type", where),
        )
    )
    scheme = _mmcif_loop(
        data,
        "_pdbx_poly_seq_scheme",
        (
            "asym_id",
            "entity_id",
            "seq_id",
            "mon_id",
            "pdb_seq_num",
            "pdb_strand_id",
            "pdb_ins_code",
        ),
        where,
    )
    # one atom_site check: a file cut inside the atom loop has ragged columns
    _mmcif_loop(data, "_atom_site", ("label_atom_id", "Cartn_x", "Cartn_y", "Cartn_z"), where)
    # SEQRES per author chain: position → allowed residue names, author number → position
    seqres: dict[str, dict[int, list[str]]] = {}
    numbering: dict[str, dict[tuple[int, str], int]] = {}
    for row in scheme:
        if entity_types.get(row["entity_id"], "").strip("'\"") != "polypeptide(L)":
            continue
        chain_id = row["pdb_strand_id"]
        try:
            seq_id, number = int(row["seq_id"]), int(row["pdb_seq_num"])
        except ValueError as exc:
            raise ProteinDataError(
                f"{where}: _pdbx_poly_seq_scheme has a non-integer residue number ({exc})"
            ) from exc
        seqres.setdefault(chain_id, {}).setdefault(seq_id, []).append(row["mon_id"])
        code = "" if row["pdb_ins_code"] in (".", "?") else row["pdb_ins_code"]
        numbering.setdefault(chain_id, {})[(number, code)] = seq_id
    in_scheme = {row["entity_id"] for row in scheme}
    for entity_id, kind in entity_types.items():
        if kind.strip("'\"") == "polypeptide(L)" and entity_id not in in_scheme:
            raise ProteinDataError(
                f"{where}: protein entity {entity_id} has no rows in _pdbx_poly_seq_scheme "
                f"(truncated or inconsistent file)"
            )
    entity_lengths: dict[str, int] = {}
    for entity_id in _mmcif_column(data, "_entity_poly_seq.entity_id", where):
        entity_lengths[entity_id] = entity_lengths.get(entity_id, 0) + 1
    for chain_id, positions in seqres.items():
        entity = next(r["entity_id"] for r in scheme if r["pdb_strand_id"] == chain_id)
        if len(positions) != entity_lengths.get(entity, len(positions)):
            raise ProteinDataError(
                f"{where}: chain {chain_id!r} has {len(positions)} residues in "
                f"_pdbx_poly_seq_scheme but its entity {entity} has {entity_lengths[entity]} in "
                f"_entity_poly_seq (truncated or inconsistent file)"
            )
    wanted = list(seqres) if chains is None else list(chains)
    missing = [c for c in wanted if c not in seqres]
    if missing:
        raise ProteinDataError(
            f"{where}: no protein chain(s) {missing} in the file (protein chains: {sorted(seqres)})"
        )
    if not wanted:
        raise ProteinDataError(f"{where}: the file has no protein (polypeptide(L)) chains")
    try:
        structure = MMCIFParser(QUIET=True).get_structure(entry, io.StringIO(text))
    except (ValueError, IndexError, KeyError) as exc:
        raise ProteinDataError(f"{where}: corrupt mmCIF coordinates ({exc})") from exc
    model = _first_model(structure, where)
    out = []
    for chain_id in wanted:
        positions = sorted(seqres[chain_id])
        if positions != list(range(positions[0], positions[0] + len(positions))):
            raise ProteinDataError(
                f"{where}: chain {chain_id!r}: _pdbx_poly_seq_scheme seq_id values are not "
                f"consecutive (truncated or corrupt file)"
            )
        first = positions[0]
        letters = [three_to_one(seqres[chain_id][p][0]) or "X" for p in positions]
        placed: dict[int, object] = {}
        if chain_id in model:
            for residue in model[chain_id]:
                _, number, code = residue.id
                seq_id = numbering[chain_id].get((number, code.strip()))
                if seq_id is None:
                    continue  # a ligand or water of this chain
                if residue.get_resname() not in seqres[chain_id][seq_id]:
                    raise ProteinDataError(
                        f"{where}: chain {chain_id!r} residue {number}{code.strip()} is "
                        f"{residue.get_resname()} but SEQRES position {seq_id} is "
                        f"{'/'.join(seqres[chain_id][seq_id])}"
                    )
                placed.setdefault(seq_id - first, residue)
        index = np.arange(len(positions))
        out.append(_build_chain(f"{entry}_{chain_id}", entry, letters, index, placed, where))
    return out


_SEQRES = re.compile(r"^SEQRES")


def _pdb_seqres(text: str) -> dict[str, list[str]]:
    """Residue names per chain from PDB ``SEQRES`` records (columns 12 and 20-70)."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if _SEQRES.match(line):
            chain_id = line[11] if len(line) > 11 else " "
            out.setdefault(chain_id, []).extend(line[19:70].split())
    return out


def _place_by_number(
    letters: list[str], residues: list, observed_letters: list[str]
) -> dict[int, object] | None:
    """Observed residues on SEQRES by one constant offset between residue number and SEQRES
    position, if such an offset makes every observed residue match; else ``None``."""
    numbers = [r.id[1] for r in residues]
    if any(r.id[2].strip() for r in residues) or len(set(numbers)) != len(numbers):
        return None
    for start in range(len(letters)):
        offset = numbers[0] - start
        spots = [n - offset for n in numbers]
        if spots[-1] >= len(letters) or spots[0] < 0:
            continue
        if all(letters[s] == o for s, o in zip(spots, observed_letters)):
            return dict(zip(spots, residues))
    return None


def _place_by_alignment(
    letters: list[str], residues: list, observed_letters: list[str], where: str
) -> dict[int, object]:
    """Observed residues on SEQRES in order, by an alignment that allows gaps only in the
    observed sequence (missing residues) and no mismatches; raises if none exists."""
    from Bio.Align import PairwiseAligner

    aligner = PairwiseAligner()
    aligner.mode = "global"
    aligner.match_score, aligner.mismatch_score = 1.0, -1000.0
    with warnings.catch_warnings():  # Biopython >= 1.86 renamed these (insertion/deletion)
        warnings.simplefilter("ignore")
        aligner.target_gap_score = -1000.0  # no gap in SEQRES
        aligner.query_internal_open_gap_score = -1.0  # missing residues: gaps in the observed
        aligner.query_internal_extend_gap_score = -0.01
        aligner.query_end_gap_score = 0.0
    target, query = "".join(letters), "".join(observed_letters)
    alignment = aligner.align(target, query)[0]
    placed: dict[int, object] = {}
    for (t0, t1), (q0, q1) in zip(*alignment.aligned):
        for t, q in zip(range(t0, t1), range(q0, q1)):
            if target[t] != query[q]:
                break
            placed[t] = residues[q]
    if len(placed) != len(residues):
        raise ProteinDataError(
            f"{where}: the observed residues ({query}) cannot be placed on the SEQRES "
            f"sequence ({target}) without mismatches"
        )
    return placed


def parse_pdb(path: str | os.PathLike, chains: Sequence[str] | None = None) -> list[Chain]:
    """Protein chains of a PDB file (first model; ``Bio.PDB.PDBParser``).

    With ``SEQRES`` records, observed residues are placed on the SEQRES sequence by residue
    number (one offset for the chain) or, when numbering does not fit (insertion codes,
    renumbering), by an in-order alignment without mismatches; an observed residue that fits
    nowhere raises. Without ``SEQRES``, the sequence is the observed residues and the residue
    index their author numbers (numbering gaps stay gaps). Residues without a Cα and
    non-amino-acid groups (water, ligands) are left out.
    """
    from Bio.PDB import PDBParser

    path = Path(path)
    where = str(path)
    text = _open_text(path)
    if not any(line.startswith(("ATOM", "HETATM")) for line in text.splitlines()):
        raise ProteinDataError(f"{where}: no ATOM/HETATM records (empty or not a PDB file)")
    try:
        structure = PDBParser(QUIET=True).get_structure(entry_of(path), io.StringIO(text))
    except (ValueError, IndexError, KeyError) as exc:
        raise ProteinDataError(f"{where}: corrupt PDB file ({exc})") from exc
    model = _first_model(structure, where)
    seqres = _pdb_seqres(text)
    entry = entry_of(path)
    observed_chains: dict[str, list] = {}
    for chain in model:
        residues = [r for r in chain if three_to_one(r.get_resname()) and "CA" in r]
        if residues:
            observed_chains[chain.id] = residues
    protein_seqres = {
        c: names for c, names in seqres.items() if sum(map(bool, map(three_to_one, names))) > 0
    }
    available = sorted(set(observed_chains) | set(protein_seqres))
    wanted = available if chains is None else list(chains)
    missing = [c for c in wanted if c not in available]
    if missing:
        raise ProteinDataError(
            f"{where}: no protein chain(s) {missing} in the file (protein chains: {available})"
        )
    if not wanted:
        raise ProteinDataError(f"{where}: no protein chains (no amino-acid residues with Cα)")
    out = []
    for chain_id in wanted:
        residues = observed_chains.get(chain_id, [])
        observed_letters = [three_to_one(r.get_resname()) or "X" for r in residues]
        if chain_id in protein_seqres:
            letters = [three_to_one(n) or "X" for n in protein_seqres[chain_id]]
            placed = _place_by_number(letters, residues, observed_letters) if residues else {}
            if placed is None:
                placed = _place_by_alignment(letters, residues, observed_letters, where)
            index = np.arange(len(letters))
        else:
            letters = observed_letters
            placed = dict(enumerate(residues))
            index = _author_index(residues)
        out.append(_build_chain(f"{entry}_{chain_id}", entry, letters, index, placed, where))
    return out


def _author_index(residues: list) -> np.ndarray:
    """Residue index from author numbers, starting at 0; an insertion code adds one so that
    the index keeps increasing."""
    index, shift, previous = [], 0, None
    for residue in residues:
        number = residue.id[1]
        if previous is not None and number <= previous:
            shift += previous - number + 1
        index.append(number + shift)
        previous = number
    values = np.asarray(index, dtype=np.int64)
    return values - values[0]


# -- features ------------------------------------------------------------------------------


def deletion_transform(d: np.ndarray) -> np.ndarray:
    """AF2's deletion value ``2/π · atan(d / 3)`` (float32)."""
    return (2.0 / math.pi * np.arctan(np.asarray(d, dtype=np.float64) / 3.0)).astype(np.float32)


def msa_profile(rows: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """Column profile ``[L, 23]``: the share of each MSA class among the (masked) rows."""
    onehot = np.eye(NUM_MSA_CLASSES, dtype=np.float32)[rows]  # [S, L, 23]
    weight = np.ones(rows.shape, dtype=np.float32) if mask is None else mask.astype(np.float32)
    total = np.maximum(weight.sum(0), 1e-8)[:, None]
    return (onehot * weight[..., None]).sum(0) / total


def target_feat(aatype: np.ndarray) -> np.ndarray:
    """``[L, 22]``: index 0 the between-segment flag (0 here), 1..21 one-hot of aatype 0..20."""
    out = np.zeros((len(aatype), TARGET_FEAT_DIM), dtype=np.float32)
    out[np.arange(len(aatype)), aatype + 1] = 1.0
    return out


def msa_feat(rows: np.ndarray, deletions: np.ndarray, profile_rows: np.ndarray | None = None,
             profile_deletions: np.ndarray | None = None) -> np.ndarray:  # fmt: skip
    """``[S, L, 49]`` in AF2's layout for the MSA ``rows``/``deletions`` ``[S, L]``.

    ``[0:23]`` one-hot residue class, ``[23]`` has_deletion, ``[24]`` deletion value,
    ``[25:48]`` the column profile and ``[48]`` the transformed mean deletion, both taken over
    ``profile_rows``/``profile_deletions`` (default: the same rows), broadcast to every row.
    """
    s, length = rows.shape
    prof_rows = rows if profile_rows is None else profile_rows
    prof_dels = deletions if profile_deletions is None else profile_deletions
    out = np.zeros((s, length, MSA_FEAT_DIM), dtype=np.float32)
    out[..., :NUM_MSA_CLASSES] = np.eye(NUM_MSA_CLASSES, dtype=np.float32)[rows]
    out[..., 23] = (deletions > 0).astype(np.float32)
    out[..., 24] = deletion_transform(deletions)
    out[..., 25:48] = msa_profile(prof_rows)[None]
    out[..., 48] = deletion_transform(prof_dels.astype(np.float64).mean(0))[None]
    return out


def single_sequence_msa(sequence: str) -> MSA:
    """The MSA of a sequence without alignments: the query row alone."""
    ids = sequence_to_ids(sequence)
    return MSA(ids[None], np.zeros((1, len(ids)), dtype=np.int64), ["query"], "query")
