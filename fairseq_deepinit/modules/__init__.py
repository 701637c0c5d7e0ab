"""Building blocks of a deepinit layer, one axis each: the norm type (:mod:`.norms`), FixNorm
(:mod:`.fixnorm`), residual scaling (:mod:`.residual`), the attention implementation
(:mod:`.attention`) and the layers that put them together through fairseq's ``build_*`` hooks
(:mod:`.layers`)."""
