"""kvrelay: disaggregated LLM serving."""
