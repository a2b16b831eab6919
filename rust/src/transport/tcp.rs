//! TCP mesh (in progress).
