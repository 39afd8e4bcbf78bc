"""Model families. One file per family; models hold no engine features."""
