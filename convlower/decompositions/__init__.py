"""aten decompositions that wire the rules (and the Snake route) into AOTAutograd graphs."""
