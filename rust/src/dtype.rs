//! Element types: the one table of the engine's dtypes, with the names torch and safetensors
//! give them.
//!
//! Collectives move and reduce the first nine ([`DType::ALL`], whose discriminants are their
//! wire tags); shard files hold those and three more ([`DType::STORED`]). Python passes
//! torch's names to collectives (`"float32"`, [`DType::parse`]) and safetensors' names to
//! shard files (`"F32"`, [`DType::parse_safetensors`]), and files store the latter.

use crate::error::{Error, Result};

/// An element type.
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
    /// Signed 16-bit integer (shard files only).
    I16 = 9,
    /// 8-bit float, 4 exponent bits, finite (torch `float8_e4m3fn`; shard files only).
    F8E4M3 = 10,
    /// 8-bit float, 5 exponent bits (torch `float8_e5m2`; shard files only).
    F8E5M2 = 11,
}

/// One row of the table: the dtype, its bytes, torch's name, safetensors' name.
struct Row(DType, usize, &'static str, &'static str);

/// Every dtype, in discriminant order (`TABLE[d as usize].0 == d`).
const TABLE: [Row; 12] = [
    Row(DType::F32, 4, "float32", "F32"),
    Row(DType::F64, 8, "float64", "F64"),
    Row(DType::F16, 2, "float16", "F16"),
    Row(DType::BF16, 2, "bfloat16", "BF16"),
    Row(DType::I8, 1, "int8", "I8"),
    Row(DType::U8, 1, "uint8", "U8"),
    Row(DType::I32, 4, "int32", "I32"),
    Row(DType::I64, 8, "int64", "I64"),
    Row(DType::Bool, 1, "bool", "BOOL"),
    Row(DType::I16, 2, "int16", "I16"),
    Row(DType::F8E4M3, 1, "float8_e4m3fn", "F8_E4M3"),
    Row(DType::F8E5M2, 1, "float8_e5m2", "F8_E5M2"),
];

// The table is in discriminant order: checked when the crate compiles.
const _: () = {
    let mut i = 0;
    while i < TABLE.len() {
        assert!(TABLE[i].0 as usize == i, "dtype TABLE out of order");
        i += 1;
    }
};

impl DType {
    /// Every dtype collectives move and reduce, in wire-tag order.
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

    /// Every dtype shard files hold, in the order error messages list them.
    pub const STORED: [DType; 12] = [
        DType::F64,
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::I64,
        DType::I32,
        DType::I16,
        DType::I8,
        DType::U8,
        DType::Bool,
        DType::F8E4M3,
        DType::F8E5M2,
    ];

    fn row(self) -> &'static Row {
        &TABLE[self as usize]
    }

    /// Parses a dtype name as torch or numpy spell it (`"float32"`, `"bfloat16"`, `"int64"`,
    /// ...), for collectives: only [`DType::ALL`].
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
                    "unsupported dtype {other:?}; shardline reduces {}",
                    Self::collective_names()
                )))
            }
        })
    }

    /// The collective dtypes' names, for messages: `"float32, float64, ... and bool"`.
    pub fn collective_names() -> String {
        let names = Self::ALL.map(|d| d.name());
        let (last, rest) = names.split_last().expect("ALL is not empty");
        format!("{} and {last}", rest.join(", "))
    }

    /// Whether collectives move and reduce this dtype (it is in [`DType::ALL`]).
    pub fn is_collective(self) -> bool {
        (self as usize) < Self::ALL.len()
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
        self.row().1
    }

    /// The name torch gives this dtype (`"float32"`, ...).
    pub fn name(self) -> &'static str {
        self.row().2
    }

    /// Whether this is a floating-point type.
    pub fn is_float(self) -> bool {
        matches!(
            self,
            DType::F32 | DType::F64 | DType::F16 | DType::BF16 | DType::F8E4M3 | DType::F8E5M2
        )
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

    /// The name safetensors gives this dtype, as shard files store it (`"F32"`, `"BF16"`,
    /// `"F8_E4M3"`, ...).
    pub fn safetensors_name(self) -> &'static str {
        self.row().3
    }

    /// The dtype with safetensors name `name`, if shard files hold it.
    pub fn from_safetensors(name: &str) -> Option<Self> {
        Self::STORED
            .into_iter()
            .find(|d| d.safetensors_name() == name)
    }

    /// Parses a safetensors dtype name, or an invalid-argument error listing the known ones.
    pub fn parse_safetensors(name: &str) -> Result<Self> {
        Self::from_safetensors(name).ok_or_else(|| {
            Error::invalid(format!(
                "unsupported dtype {name:?}; shard files hold {}",
                Self::safetensors_names()
            ))
        })
    }

    /// Every safetensors name shard files hold, for messages: `"F64, F32, ..."`.
    pub fn safetensors_names() -> String {
        Self::STORED.map(|d| d.safetensors_name()).join(", ")
    }

    /// Whether byte-plane shuffling is tried before compression (multi-byte floats).
    pub fn shuffles(self) -> bool {
        matches!(self, DType::F64 | DType::F32 | DType::F16 | DType::BF16)
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

    #[test]
    fn collective_dtypes_are_the_first_rows() {
        assert!(DType::ALL.iter().all(|d| d.is_collective()));
        assert_eq!(
            DType::STORED.iter().filter(|d| d.is_collective()).count(),
            DType::ALL.len()
        );
    }

    #[test]
    fn safetensors_names_round_trip_and_stay_as_written_in_files() {
        for d in DType::STORED {
            assert_eq!(DType::from_safetensors(d.safetensors_name()), Some(d));
        }
        assert_eq!(
            DType::safetensors_names(),
            "F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL, F8_E4M3, F8_E5M2"
        );
        let err = DType::parse_safetensors("float32").unwrap_err();
        assert!(err.message.contains("shard files hold F64, F32"), "{err}");
        // Collectives keep refusing what only files hold.
        for name in ["int16", "float8_e4m3fn", "float8_e5m2", "I16"] {
            assert!(DType::parse(name).is_err(), "{name}");
        }
    }

    #[test]
    fn the_collective_message_lists_every_collective_dtype() {
        let err = DType::parse("complex64").unwrap_err();
        assert_eq!(
            err.message,
            "unsupported dtype \"complex64\"; shardline reduces float32, float64, float16, \
             bfloat16, int8, uint8, int32, int64 and bool"
        );
    }
}
