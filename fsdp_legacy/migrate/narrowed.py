"""An object the program itself has checked is an FSDP1 unit: `assert isinstance(module, FSDP)` before the code
that uses it, `if isinstance(m, FSDP):` around it, `isinstance(m, FSDP) and m.module...`, also through a name bound
once to such a test (mistral-finetune's `is_fsdp = isinstance(module, FullyShardedDataParallel)`, then `is_fsdp and
len(list(module.module.children())) == 0`). The test becomes `isinstance(m, FSDPModule)`, and every FSDP1 unit is
an FSDPModule after the migration (each unit its policy picks is sharded with fully_shard), so the object is one
there as well: its FSDP1 methods (`summon_full_params`, `state_dict()`, `.module`) take their FSDP2 forms.

Only where the text shows the check holds: the object is a name or an attribute chain (`self.model`) that nothing
rebinds between the test and the use, and no function or class defined in between (a closure reads later values)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import libcst as cst

from .bindings import Bindings
from .names import attribute_chain

IsFsdp1Class = Callable[[cst.BaseExpression], bool]
_SCOPES = (cst.FunctionDef, cst.ClassDef, cst.Lambda)
_COMPREHENSIONS = (cst.ListComp, cst.SetComp, cst.GeneratorExp, cst.DictComp)


class BoundChains(cst.CSTVisitor):
    """How often the visited code binds each name or attribute chain (assignments, unpacking, loops, `with ... as`,
    `:=`); with `every`, the names parameters, imports, defs, classes and comprehensions bind too."""

    def __init__(self, every: bool = False) -> None:
        super().__init__()
        self.every = every
        self.bound: Counter[str] = Counter()

    def bind(self, target: cst.BaseExpression) -> None:
        chain = attribute_chain(target)
        if chain is not None:
            self.bound[chain] += 1
        elif isinstance(target, (cst.Tuple, cst.List)):
            for element in target.elements:
                self.bind(element.value)
        elif isinstance(target, cst.StarredElement):
            self.bind(target.value)

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        self.bind(node.target)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self.bind(node.target)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self.bind(node.target)

    def visit_For(self, node: cst.For) -> None:
        self.bind(node.target)

    def visit_AsName(self, node: cst.AsName) -> None:
        if isinstance(node.name, cst.BaseExpression):
            self.bind(node.name)

    def visit_NamedExpr(self, node: cst.NamedExpr) -> None:
        self.bind(node.target)

    def visit_CompFor(self, node: cst.CompFor) -> None:
        if self.every:
            self.bind(node.target)

    def visit_Param(self, node: cst.Param) -> None:
        if self.every:
            self.bind(node.name)

    def visit_ImportAlias(self, node: cst.ImportAlias) -> None:
        if self.every and node.asname is None:  # (`import a.b` binds `a`; an `as` name is an AsName)
            self.bound[cst.Module([]).code_for_node(node.name).split(".")[0]] += 1

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        if self.every:
            self.bind(node.name)

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        if self.every:
            self.bind(node.name)


def _rebinds(nodes: list[cst.CSTNode], chain: str, targets: tuple[cst.BaseExpression, ...] = ()) -> bool:
    """Whether any of `nodes`, or `targets` themselves, binds `chain` or the name (or shorter chain) it starts from."""
    found = BoundChains()
    for node in nodes:
        node.visit(found)
    for target in targets:
        found.bind(target)
    parts = chain.split(".")
    return any(".".join(parts[:n]) in found.bound for n in range(1, len(parts) + 1))


class Narrowing:
    """Answers whether an object is checked to be an FSDP1 unit where it is used."""

    def __init__(self, bindings: Bindings, is_fsdp1_class: IsFsdp1Class, code: Callable[[cst.CSTNode], str]) -> None:
        self.bindings = bindings
        self.is_fsdp1_class = is_fsdp1_class
        self.code = code

    def unit(self, receiver: cst.BaseExpression, node: cst.CSTNode) -> bool:
        """Whether `receiver` at `node` (inside it) is an object a test of the program has shown is FSDP1's."""
        chain = attribute_chain(receiver)
        if chain is None:
            return False
        parents = self.bindings.parents
        current: cst.CSTNode = node
        while True:
            parent = parents.get(current)
            if parent is None or isinstance(current, _SCOPES):
                return False
            if isinstance(parent, cst.BooleanOperation) and isinstance(parent.operator, cst.And):
                if current is parent.right and self._tests(parent.left, chain):
                    return True
            elif isinstance(parent, cst.IfExp) and current is parent.body:
                if self._tests(parent.test, chain) and not _rebinds([parent.body], chain):
                    return True
            elif isinstance(parent, cst.If) and current is parent.body:
                if self._tests(parent.test, chain) and not _rebinds([parent.body], chain):
                    return True
            elif isinstance(parent, (cst.IndentedBlock, cst.Module)) and self._asserted_before(parent, current, chain):
                return True
            elif isinstance(parent, _COMPREHENSIONS) and current is not parent.for_in:
                if self._filtered(parent.for_in, chain):
                    return True
            current = parent

    def _filtered(self, clause: cst.CompFor, chain: str) -> bool:
        """Whether a comprehension's `if` tests `chain`, no later `for` of it rebinding the object."""
        clauses = [clause]
        while clauses[-1].inner_for_in is not None:
            clauses.append(clauses[-1].inner_for_in)
        for index, each in enumerate(clauses):
            if any(self._tests(condition.test, chain) for condition in each.ifs):
                return not _rebinds([], chain, tuple(c.target for c in clauses[index + 1 :]))
        return False

    def _asserted_before(self, block: cst.IndentedBlock | cst.Module, statement: cst.CSTNode, chain: str) -> bool:
        """Whether a statement `assert <test of chain>` comes before `statement` in `block`, with nothing between
        them (nor `statement` itself) rebinding `chain`."""
        body: list[cst.CSTNode] = list(block.body)
        if statement not in body:
            return False
        earlier = body[: body.index(statement)]
        for index in range(len(earlier) - 1, -1, -1):
            line = earlier[index]
            if isinstance(line, cst.SimpleStatementLine) and any(
                isinstance(small, cst.Assert) and self._tests(small.test, chain) for small in line.body
            ):
                return not _rebinds([*earlier[index + 1 :], statement], chain)
        return False

    def _tests(self, test: cst.BaseExpression, chain: str) -> bool:
        """Whether `test` being true means `chain` is an FSDP1 instance."""
        if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And):
            return self._tests(test.left, chain) or self._tests(test.right, chain)
        if isinstance(test, cst.Call) and self.code(test.func) == "isinstance" and len(test.args) == 2:
            checked, kind = test.args[0], test.args[1]
            if checked.keyword or kind.keyword or checked.star or kind.star:
                return False
            return attribute_chain(checked.value) == chain and self.is_fsdp1_class(kind.value)
        if isinstance(test, cst.Name):  # a name bound once to such a test, the object not rebound in its function
            binding = self.bindings.single(test)
            if binding is None or not self._tests(binding.value, chain):
                return False
            function = self.bindings.enclosing(binding.statement, cst.FunctionDef)
            return function is not None and not _rebinds([function.body], chain)
        return False
