"""The offline stages, `tandem sft`, `tandem rm`, `tandem dpo`: one loop, what differs per stage, their data and their report."""
