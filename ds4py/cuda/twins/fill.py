"""Twin of cu/fill.cu: the splitmix64 stream is host code the doctor uses too, so it lives in ds4py.host.fill."""

from ds4py.host.fill import U64, block_fields, i32_rows, mix, random_u32, uniform, unit  # noqa: F401
