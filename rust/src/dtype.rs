//! Element types the engine moves and reduces.

use crate::error::{Error, Result};

/// An element type, tagged by the name torch and numpy use for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    /// 32-bit IEEE float.
    F32 = 0,
    /// 64-bit IEEE float.
    F64 = 1,
    /// 16-bit IEEE float; reduced with f32 accumulation.
    F16 = 2,
    /// bfloat16; reduced with f32 accumulation.
    BF16 = 3,
    /// Signed 8-bit integer.
    I8 = 4,
    /// Unsigned 8-bit integer.
    U8 = 5,
    /// Signed 32-bit integer.
    I32 = 6,
    /// Signed 64-bit integer.
    I64 = 7,
    /// Boolean stored as one byte (0 or 1).
    Bool = 8,
}

impl DType {
    /// Every dtype, in tag order.
    pub const ALL: [DType; 9] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I8,
        DType::U8,
        DType::I32,
        DType::I64,
        DType::Bool,
    ];

    /// Parses a dtype name as torch or numpy spell it (`"float32"`, `"bfloat16"`, `"int64"`, ...).
    pub fn parse(name: &str) -> Result<Self> {
        Ok(match name {
            "float32" | "f32" | "float" => DType::F32,
            "float64" | "f64" | "double" => DType::F64,
            "float16" | "f16" | "half" => DType::F16,
            "bfloat16" | "bf16" => DType::BF16,
            "int8" | "i8" => DType::I8,
            "uint8" | "u8" => DType::U8,
            "int32" | "i32" | "int" => DType::I32,
            "int64" | "i64" | "long" => DType::I64,
            "bool" => DType::Bool,
            other => {
                return Err(Error::invalid(format!(
                    "unsupported dtype {other:?}; shardline reduces float32, float64, float16, \
                     bfloat16, int8, uint8, int32, int64 and bool"
                )))
            }
        })
    }

    /// The dtype for a wire tag, if the tag is known.
    pub fn from_tag(tag: u8) -> Option<Self> {
        Self::ALL.get(tag as usize).copied()
    }

    /// The wire tag of this dtype.
    pub fn tag(self) -> u8 {
        self as u8
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    /// The name torch gives this dtype (`"float32"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::I8 => "int8",
            DType::U8 => "uint8",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::Bool => "bool",
        }
    }

    /// Whether this is a floating-point type.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// Number of whole elements in `bytes`, or an error naming the op if it is not a multiple.
    pub fn count_of(self, bytes: usize, what: &str) -> Result<usize> {
        if bytes % self.size() != 0 {
            return Err(Error::invalid(format!(
                "{what}: buffer of {bytes} bytes is not a whole number of {} elements ({} bytes each)",
                self.name(),
                self.size()
            )));
        }
        Ok(bytes / self.size())
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_round_trip_and_names_parse() {
        for d in DType::ALL {
            assert_eq!(DType::from_tag(d.tag()), Some(d));
            assert_eq!(DType::parse(d.name()).unwrap(), d);
        }
        assert_eq!(DType::from_tag(9), None);
        assert!(DType::parse("complex64").is_err());
    }

    #[test]
    fn count_of_rejects_partial_elements() {
        assert_eq!(DType::F32.count_of(16, "x").unwrap(), 4);
        let err = DType::F32.count_of(6, "all_reduce").unwrap_err();
        assert!(err.to_string().contains("all_reduce"), "{err}");
    }
}
