# Variant (run inside a copy of the tree by `h200_lease.sh var` / `var_thr`): the tree as committed, for a
# baseline run in the same stage and the same way as the other variants.
true
