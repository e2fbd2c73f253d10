//! The synced resources and the changes resource tasks hand to the merger.

use std::fmt;

use serde::de::DeserializeOwned;

use crate::model::{Credential, Model, ModelInstance, Worker};

/// One of the collections the data plane mirrors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum ResourceKind {
    Workers,
    ModelInstances,
    Models,
    Credentials,
}

impl ResourceKind {
    /// Every resource; the data plane is synced once each has been listed.
    pub(crate) const ALL: [ResourceKind; 4] = [
        ResourceKind::Workers,
        ResourceKind::ModelInstances,
        ResourceKind::Models,
        ResourceKind::Credentials,
    ];

    /// The path segment under `/v2/`.
    pub(crate) fn path(self) -> &'static str {
        match self {
            ResourceKind::Workers => "workers",
            ResourceKind::ModelInstances => "model-instances",
            ResourceKind::Models => "models",
            ResourceKind::Credentials => "credentials",
        }
    }

    /// Position in [`ALL`](Self::ALL).
    pub(crate) fn index(self) -> usize {
        self as usize
    }

    /// Whether a server may lack this resource. GPUStack has no credential feed (it answers
    /// 404): the data plane then knows no keys but must still route.
    pub(crate) fn optional(self) -> bool {
        self == ResourceKind::Credentials
    }
}

impl fmt::Display for ResourceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.path())
    }
}

/// A change to one resource's collection.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Change<T> {
    /// A complete list: replaces everything known about the resource.
    Replace(Vec<T>),
    /// Created or updated object.
    Upsert(T),
    /// Deleted object, by id.
    Delete(i64),
}

/// A [`Change`] tagged with its resource.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Update {
    Workers(Change<Worker>),
    ModelInstances(Change<ModelInstance>),
    Models(Change<Model>),
    Credentials(Change<Credential>),
}

/// What a resource task sends to the merger.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Message {
    pub(crate) update: Update,
    /// The store revision this change reflects, when the server reports one.
    pub(crate) revision: Option<u64>,
}

/// A wire type the sync client mirrors.
pub(crate) trait Resource:
    DeserializeOwned + Clone + PartialEq + fmt::Debug + Send + Sync + 'static
{
    const KIND: ResourceKind;

    /// The object's id, the key of its collection.
    fn id(&self) -> i64;

    /// Tags a change with this resource.
    fn wrap(change: Change<Self>) -> Update;
}

macro_rules! resource {
    ($ty:ty, $kind:ident) => {
        impl Resource for $ty {
            const KIND: ResourceKind = ResourceKind::$kind;

            fn id(&self) -> i64 {
                self.id
            }

            fn wrap(change: Change<Self>) -> Update {
                Update::$kind(change)
            }
        }
    };
}

resource!(Worker, Workers);
resource!(ModelInstance, ModelInstances);
resource!(Model, Models);
resource!(Credential, Credentials);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_matches_position_in_all() {
        for (i, kind) in ResourceKind::ALL.iter().enumerate() {
            assert_eq!(kind.index(), i);
        }
    }
}
