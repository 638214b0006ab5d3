"""Harnesses: what runs rollq on purpose to show, measure or break it (`rollq demo`, `rollq chaos`,
`rollq bench`, the fault helpers the tests share). The product never imports from here."""
