//! A node's attributes, read by name, for the importer and the folder alike.

use super::pb::AttributeProto;
use super::tensor::{Tensor, decode};

/// A node's attributes, looked up by name.
pub(crate) struct Attrs<'a>(pub &'a [AttributeProto]);

impl Attrs<'_> {
    pub(crate) fn get(&self, name: &str) -> Option<&AttributeProto> {
        self.0.iter().find(|a| a.name() == name)
    }

    pub(crate) fn int(&self, name: &str) -> Option<i64> {
        self.get(name).map(|a| a.i())
    }

    pub(crate) fn ints(&self, name: &str) -> Option<Vec<i64>> {
        self.get(name).map(|a| a.ints.clone())
    }

    pub(crate) fn float(&self, name: &str) -> Option<f32> {
        self.get(name).map(|a| a.f())
    }

    pub(crate) fn string(&self, name: &str) -> Option<String> {
        self.get(name)
            .map(|a| String::from_utf8_lossy(a.s()).into_owned())
    }

    pub(crate) fn tensor(&self, name: &str) -> Result<Option<Tensor>, String> {
        match self.get(name).and_then(|a| a.t.as_ref()) {
            Some(t) => decode(t, None)
                .map(Some)
                .map_err(|e| format!("attribute `{name}`: {e}")),
            None => Ok(None),
        }
    }
}
