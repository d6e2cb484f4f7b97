"""The docs against the code, the manifests and the chart: what a reader is told is what runs.

Each test reads a doc and the thing it describes and compares them, so a flag, a permission, a default or a
heading that changes on one side only fails here: the README's flags table against `gpuguard watch`'s
options, its RBAC summary against the manifest's ClusterRole, the chart's value comments against the agent's
defaults, the Kubernetes floor everywhere it is stated, every heading a comment or a link points to, the
image name, the dry-run syntax, the plain manifest's dry-run start, and design.md's module table against the
import contracts.
"""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import click
import yaml

from gpuguard.cli import cli
from gpuguard.cli.flags import FLAGS, WATCH_FLAGS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
DESIGN = DOCS / "design.md"
OPERATIONS = DOCS / "operations.md"
MANIFEST = ROOT / "deploy" / "daemonset.yaml"
CHART = ROOT / "deploy" / "helm" / "gpuguard"
VALUES = CHART / "values.yaml"
TEMPLATE = CHART / "templates" / "daemonset.yaml"
NOTES = CHART / "templates" / "NOTES.txt"
WATCH: click.Command = cli.commands["watch"]


def _section(text: str, heading: str) -> str:
    """The text under a markdown heading, up to the next heading of any level."""
    start = re.search(rf"^#+ {re.escape(heading)}$", text, re.M)
    assert start, heading
    end = re.search(r"^#+ ", text[start.end() :], re.M)
    return text[start.end() : start.end() + end.start() if end else len(text)]


def _sh_blocks(text: str) -> list[str]:
    return re.findall(r"^```sh\n(.*?)^```$", text, re.M | re.S)


def _shown(value: Any) -> str:
    """A flag's default as the docs write it: 3.0 as 3, 600.0 as 600."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


# -- the README's flags table and `gpuguard watch` -----------------------------------------------------------


def _flag_rows() -> dict[str, str]:
    """Each flag the README's table names -> the row's default cell."""
    rows: dict[str, str] = {}
    for line in _section(README.read_text(), "Flags").splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) != 3 or not cells[0].startswith("`--"):
            continue
        for flag in re.findall(r"`(--[a-z0-9-]+)", cells[0]):
            rows[flag] = cells[1]
    return rows


def test_the_readme_flags_table_names_every_flag_of_watch_and_its_default() -> None:
    options = {p.opts[0]: p for p in WATCH.params if isinstance(p, click.Option) and not p.hidden}
    rows = _flag_rows()
    assert sorted(rows) == sorted(options), "the README's flags table and `gpuguard watch --help` differ"
    for flag, option in options.items():
        if option.show_default and not option.is_flag:
            assert f"`{_shown(option.default)}`" in rows[flag], (flag, option.default, rows[flag])


def test_the_readme_flags_table_and_its_environment_are_the_flag_declarations() -> None:
    """gpuguard.cli.flags declares each flag once: the table names every visible flag of `watch` with its
    declared default, and the prose above it the variables: GPUGUARD_<FLAG_NAME> for each, the other
    variables a flag reads, and the flags whose empty variable means the empty flag."""
    visible = [FLAGS[n] for n in WATCH_FLAGS if not FLAGS[n].hidden]
    rows = _flag_rows()
    assert sorted(rows) == sorted(f.name for f in visible)
    for flag in visible:
        default = flag.click_default
        if flag.is_flag:
            assert rows[flag.name] == "off", flag.name
        elif default not in (None, ""):
            assert f"`{_shown(default)}`" in rows[flag.name], (flag.name, default, rows[flag.name])
    prose = " ".join(_section(README.read_text(), "Flags").split("| flag |")[0].split())
    example = FLAGS["ecc_threshold"]
    assert f"`GPUGUARD_<FLAG_NAME>` (`{example.name}` is `{example.env}`)" in prose
    assert all(f.env == "GPUGUARD_" + f.name[2:].upper().replace("-", "_") for f in FLAGS.values())
    for flag in FLAGS.values():
        for variable in flag.envvars:
            assert f"`{flag.name}` also from `{variable}`" in prose, (flag.name, variable)
    empty = re.search(r"An empty (.*?) means the same as the empty flag", prose)
    assert empty, "the README says which empty variables mean the empty flag"
    assert set(re.findall(r"`(GPUGUARD_\w+)`", empty[1])) == {f.env for f in FLAGS.values() if f.empty_env}


def test_the_flags_table_and_help_name_the_hidden_flags_nowhere() -> None:
    """The hidden flags (tests and tuning) stay out of both, so the comparison above is of the same set."""
    hidden = {p.opts[0] for p in WATCH.params if isinstance(p, click.Option) and p.hidden}
    assert hidden and not hidden & set(_flag_rows())


# -- RBAC: the README's summary and the manifest's comment against its ClusterRole ---------------------------


def _manifest_docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def _cluster_role_grants() -> dict[str, set[str]]:
    (role,) = [d for d in _manifest_docs() if d["kind"] == "ClusterRole"]
    grants: dict[str, set[str]] = {}
    for rule in role["rules"]:
        for resource in rule["resources"]:
            grants.setdefault(resource, set()).update(rule["verbs"])
    return grants


def test_the_readmes_rbac_summary_is_exactly_the_manifests_cluster_role() -> None:
    deploy = _section(README.read_text(), "Deploy")
    summary = re.search(r"a ClusterRole with only (.*?), a Role", " ".join(deploy.split()))
    assert summary, "the README's Deploy section names the ClusterRole's grants"
    told: dict[str, set[str]] = {}
    for resource, verbs in re.findall(
        r"([a-z]+(?:/[a-z]+)?) ((?:[a-z]+/)*[a-z]+)(?:,| and| \(|$)", summary[1]
    ):
        told[resource] = set(verbs.split("/"))
    assert told == _cluster_role_grants()


def test_the_manifests_rbac_comment_calls_no_granted_verb_not_granted() -> None:
    text = MANIFEST.read_text()
    line = re.search(r"^# Not granted: nodes ([a-z/]+)", text, re.M)
    assert line, "the comment above the ClusterRole says what is not granted"
    assert not set(line[1].split("/")) & _cluster_role_grants()["nodes"], line[0]


# -- the chart's values against the agent's defaults ---------------------------------------------------------


def _value_comments() -> dict[str, tuple[Any, str]]:
    """Each leaf of values.yaml (a dotted path) -> (its value, the comment block right above it)."""
    values = yaml.safe_load(VALUES.read_text())
    out: dict[str, tuple[Any, str]] = {}
    stack: list[tuple[int, str]] = []
    comment: list[str] = []
    for line in VALUES.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            comment.append(stripped.lstrip("# "))
            continue
        m = re.match(r"^( *)([A-Za-z][\w.-]*):", line)
        if not m:
            comment = [] if not stripped else comment
            continue
        indent, key = len(m[1]), m[2]
        stack = [(i, k) for i, k in stack if i < indent]
        stack.append((indent, key))
        path = [k for _, k in stack]
        node: Any = values
        for k in path:
            node = node[k] if isinstance(node, dict) else None
        out[".".join(path)] = (node, " ".join(comment))
        comment = []
    return out


def _chart_variables() -> dict[str, str]:
    """values.yaml path -> the GPUGUARD_ variable the template renders from it (when set)."""
    text = TEMPLATE.read_text()
    pairs = re.findall(
        r'\{\{- if include "gpuguard\.isSet" \(?\.Values\.(\w+)\)?((?:\.\w+)?) \}\}'
        r"\s*- name: (GPUGUARD_\w+)",
        text,
    )
    return {a + b: var for a, b, var in pairs}


def _agent_default(variable: str) -> Any:
    for p in WATCH.params:
        if isinstance(p, click.Option) and p.envvar == variable:
            return p.default
    raise AssertionError(f"{variable} is no variable of gpuguard watch")


def test_every_chart_value_called_null_is_null_and_the_default_it_names_is_the_agents() -> None:
    variables = _chart_variables()
    assert {"interval", "flapWindow", "quarantine.mode", "apiServer.qps"} <= set(variables)
    checked = 0
    for path, (value, comment) in _value_comments().items():
        m = re.search(r"\bnull: the agent's defaults?[,(]? ?([\w.%/-]+)", comment)
        if not m:
            continue
        assert value is None, f"{path} is {value!r} but its comment says null: {comment}"
        if path in variables:
            assert m[1].rstrip(".,)") == _shown(_agent_default(variables[path])), (path, comment)
            checked += 1
    assert checked >= 5


def test_a_value_the_chart_sets_says_so_and_names_the_same_default_as_the_agent() -> None:
    """A value that is not null is spelled out (as deploy/daemonset.yaml spells it out): it must be the
    agent's own default, so the chart and the agent run alike."""
    comments = _value_comments()
    for path, variable in _chart_variables().items():
        value = comments[path][0]
        if value is not None:
            assert _shown(value) == _shown(_agent_default(variable)), (path, value)


# -- the Kubernetes floor ------------------------------------------------------------------------------------


def test_the_kubernetes_floor_is_the_same_in_the_chart_values_manifest_readme_and_operations() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    floor = re.fullmatch(r">=1\.(\d+)\.0-0", chart["kubeVersion"])
    assert floor
    minor = int(floor[1])
    span = f"1.{minor} to 1."
    assert f"**Kubernetes {span}" in README.read_text()
    assert f"Kubernetes: {span}" in OPERATIONS.read_text()
    assert f"Kubernetes {span}" in MANIFEST.read_text()
    assert f"Kubernetes {span}" in (CHART / "Chart.yaml").read_text()
    values = VALUES.read_text()
    assert f"Needs Kubernetes >= 1.{minor}" in values
    # No older version is offered as working anywhere in the values' comments.
    older = [v for v in re.findall(r"\b1\.(\d\d)\b", values) if int(v) < minor]
    assert not older, older


# -- headings and links --------------------------------------------------------------------------------------


def _headings(path: Path) -> list[str]:
    return [h.replace("`", "") for h in re.findall(r"^#+ (.+)$", path.read_text(), re.M)]


def _titles(path: Path) -> list[str]:
    """Headings and the bold leads of paragraphs (`**The budget counts GPUs as well as nodes.**`)."""
    return _headings(path) + re.findall(r"^\*\*([^*]+?)\.?\*\*", path.read_text(), re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


DOC_FILES = [README, *sorted(DOCS.glob("*.md"))]
POINTING_FILES = [
    *DOC_FILES,
    *sorted((ROOT / "deploy").rglob("*.yaml")),
    *sorted((CHART / "templates").glob("*.txt")),
    *sorted((ROOT / "gpuguard").rglob("*.py")),
]


def test_every_heading_a_comment_or_a_doc_names_in_quotes_exists() -> None:
    """`README "Startup gate"`, `docs/operations.md, "Reading a quarantine"`: a heading or a paragraph's bold
    lead, or the start of one."""
    broken = []
    for path in POINTING_FILES:
        text = " ".join(re.sub(r"^\s*#\s?", "", path.read_text(), flags=re.M).split())
        for doc, title in re.findall(r"\b(README|docs/\w+\.md|\w+\.md)\)?,? \"([^\"]+)\"", text):
            target = README if doc == "README" else DOCS / Path(doc).name
            if not target.exists():
                broken.append(f"{path.name}: {doc} does not exist")
            elif not any(h.startswith(title) for h in _titles(target)):
                broken.append(f'{path.name}: {doc} "{title}"')
    assert not broken, broken


def test_every_relative_link_of_the_docs_reaches_a_file_and_its_anchor() -> None:
    broken = []
    for path in DOC_FILES:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            anchors = {_slug(h) for h in _headings(dest)} if dest.suffix == ".md" and dest.exists() else set()
            if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in anchors):
                broken.append(f"{path.name}: {target}")
    assert not broken, broken


# -- the image -----------------------------------------------------------------------------------------------


def test_the_image_is_one_placeholder_under_a_reserved_domain_as_nothing_is_published() -> None:
    """The README says no image is published; an image under a real-looking registry would contradict it (and
    a squatter could publish one). Every default names the same placeholder, under example.com (RFC 2606)."""
    readme = README.read_text()
    assert "Nothing is published" in _section(readme, "The image")
    values = yaml.safe_load(VALUES.read_text())["image"]["repository"]
    chart_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    pod = next(d for d in _manifest_docs() if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    images = {c["image"] for c in pod["containers"] + pod["initContainers"]}
    example = yaml.safe_load_all((ROOT / "deploy" / "examples" / "inference-preflight.yaml").read_text())
    preflight = {
        c["image"]
        for d in example
        if d and d["kind"] == "Deployment"
        for c in d["spec"]["template"]["spec"]["initContainers"]
    }
    assert images == preflight == {f"{values}:{chart_version}"}
    assert values.split("/")[0].endswith("example.com")
    assert f"docker build -t {values}:{chart_version} ." in readme


# -- dry run: one syntax, and both install paths start in it -------------------------------------------------

DRY_RUN_SET = "--set-json 'extraArgs=[\"--dry-run\"]'"


def test_the_charts_notes_and_the_readme_give_the_same_dry_run_syntax() -> None:
    assert DRY_RUN_SET in README.read_text()
    assert DRY_RUN_SET in OPERATIONS.read_text()
    notes = NOTES.read_text()
    assert DRY_RUN_SET in notes
    assert "extraArgs={" not in notes


def test_the_readmes_plain_manifest_install_starts_in_dry_run_like_the_helm_install() -> None:
    """The manifest as shipped enforces (it is what runs after the first week, and the chart's default
    render); the README's first apply turns on --dry-run on the way, as the Helm install does with a value."""
    deploy = _section(README.read_text(), "Deploy")
    first = next(b for b in _sh_blocks(deploy) if "kubectl apply" in b)
    filter_cmd = first.split("|")[0].strip()
    assert filter_cmd.startswith("sed ") and "deploy/daemonset.yaml" in filter_cmd
    rendered = subprocess.run(
        ["bash", "-c", filter_cmd], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    ds = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "DaemonSet")
    assert ds["spec"]["template"]["spec"]["containers"][0]["args"] == ["watch", "--dry-run"]
    shipped = next(d for d in _manifest_docs() if d["kind"] == "DaemonSet")
    assert shipped["spec"]["template"]["spec"]["containers"][0]["args"] == ["watch"]
    assert "kubectl apply -f deploy/daemonset.yaml" in deploy  # enforcing: the file as shipped


# -- design.md's module table and the import contracts -------------------------------------------------------


def _contract_modules() -> set[str]:
    """Every module the import contracts of pyproject.toml name, as a path under gpuguard/."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    names: set[str] = set()
    for c in contracts:
        if c["type"] != "layers":
            # A rule's modules (forbidden, independence): the package's own; "gpuguard" whole is no module.
            for key in ("source_modules", "forbidden_modules", "modules"):
                names |= {m for m in c.get(key, ()) if m.startswith("gpuguard.")}
            continue
        prefix = [f"{c['containers'][0]}."] if "containers" in c else [""]
        for layer in c["layers"]:
            # "a | b": independent siblings; "a : b": siblings that may import each other.
            for name in re.split(r"[|:]", layer):
                names.add(prefix[0] + name.strip())
    return {n.removeprefix("gpuguard.").replace(".", "/") for n in names}


def test_design_md_lists_every_module_the_import_contracts_name_and_every_module_of_the_package() -> None:
    table = _section(DESIGN.read_text(), "Layers").split("The layers are checked")[0]
    listed: set[str] = set()
    # A row names its package or module first, and may name the modules a reader must know anywhere in it.
    for cell in re.findall(r"^\|(.+)\|$", table, re.M):
        first = re.search(r"`gpuguard/([\w/]+?)(?:\.py|/)`", cell)
        folder = first[1].rsplit("/", 1)[0] + "/" if first and "/" in first[1] else ""
        for ref in re.findall(r"`(?:gpuguard/)?([\w/]+?)(?:\.py|/)?`", cell):
            listed.add(ref if "/" in ref or not folder else folder + ref)
    # A package is either one row (`gpuguard/nvml/`) or a row per module (`gpuguard/kube/client.py`, ...).
    whole = {ref for ref in listed if (ROOT / "gpuguard" / ref).is_dir()}
    packages = {
        str(d.relative_to(ROOT / "gpuguard"))
        for d in (ROOT / "gpuguard").rglob("*")
        if d.is_dir() and (d / "__init__.py").exists()
    }
    modules = {
        str(p.relative_to(ROOT / "gpuguard")).removesuffix(".py")
        for p in (ROOT / "gpuguard").rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
        and not any(str(p.relative_to(ROOT / "gpuguard")).startswith(w + "/") for w in whole)
    }
    wanted = (_contract_modules() | modules) - (packages - whole)
    assert not wanted - listed, f"design.md's table leaves out {sorted(wanted - listed)}"
    prose = " ".join(_section(DESIGN.read_text(), "Layers").split())
    for name in _contract_modules() - (packages - whole):
        assert re.search(
            rf"\b{re.escape(name.split('/')[-1])}\b", prose.split("The layers are checked")[1]
        ), name


# -- operations.md: what to do for every reason gpuguard writes -------------------------------------------


def _reasons_written() -> set[str]:
    """Every reason a Fault of gpuguard's can carry, read from the code: the first argument of each
    `Fault(...)` in the package, a model constant or `xid_reason`/`recovery_reason` (each action of
    model.RECOVERY_ACTIONS but none, and `recovery-<N>` for an action newer than the table)."""
    import ast

    from gpuguard.core import model

    reasons: set[str] = set()
    for path in (ROOT / "gpuguard").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Fault" and node.args):
                continue
            arg = node.args[0]
            if isinstance(arg, ast.Name) and arg.id.isupper():
                reasons.add(getattr(model, arg.id))
            elif isinstance(arg, ast.Call) and getattr(arg.func, "id", None) == "xid_reason":
                reasons.add("xid-N")
            elif isinstance(arg, ast.Call) and getattr(arg.func, "id", None) == "recovery_reason":
                reasons |= {model.recovery_reason(a) for a in model.RECOVERY_ACTIONS if a} | {"recovery-<N>"}
            elif isinstance(arg, ast.Name):  # a variable: what it is assigned from, checked below
                reasons.add(f"<{arg.id}>")
    return reasons


def test_releasing_a_node_says_what_to_do_for_every_reason_gpuguard_writes() -> None:
    reasons = _reasons_written()
    variables = {r for r in reasons if r.startswith("<")}
    # policy.py's `reason` comes from a table of model constants, each of which is named in a Fault too.
    assert variables == {"<reason>"}, variables
    reasons -= variables
    assert {"ecc", "xid-N", "reset-required", "gpu-unreadable", "recovery-gpu-reset"} <= reasons
    section = _section(OPERATIONS.read_text(), "Releasing a node after repair")
    named = set(re.findall(r"`([a-z0-9<>N-]+)`", section))
    assert not reasons - named, f"no 'what to do' for {sorted(reasons - named)}"


# -- every kubectl and helm line of the docs is run --------------------------------------------------------


def test_every_kubectl_and_helm_block_of_the_docs_is_one_a_test_runs() -> None:
    """tests/integration/test_operations.py runs every ```sh block of operations.md in order, and the
    README's Deploy blocks (the plain manifests; the Helm install is operations.md's first block). A
    kubectl or helm line in a block anywhere else would be run by nobody."""
    run = _sh_blocks(OPERATIONS.read_text()) + _sh_blocks(_section(README.read_text(), "Deploy"))
    stray = []
    for path in DOC_FILES:
        for block in re.findall(r"^```(?:sh|bash|shell|console)\n(.*?)^```$", path.read_text(), re.M | re.S):
            if re.search(r"(^|[|;&]\s*)(kubectl|helm) ", block, re.M) and block not in run:
                stray.append(f"{path.name}: {block.splitlines()[0]}")
    assert not stray, stray
