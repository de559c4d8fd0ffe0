"""The one Markdown table writer: its lines against a table written by hand, cells given as any value."""

from zoo.runtime.console import markdown_table


def test_a_table_is_its_header_its_rule_and_a_line_a_row():
    lines = markdown_table(("model", "top-1", "steps"), [["`vit_nano`", 0.813, 328], iter(["hybrid", None, 1])])
    assert "\n".join(lines) == ("| model | top-1 | steps |\n"
                                "|---|---|---|\n"
                                "| `vit_nano` | 0.813 | 328 |\n"
                                "| hybrid | None | 1 |")
    assert markdown_table(["a"], []) == ["| a |", "|---|"]
